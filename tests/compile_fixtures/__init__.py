"""Compile-test fixtures: a stand-in model with the HybridLM compile surface, and the mutated-scalar lint."""
