"""What training, evaluation and sampling share, below `megacpp.train` and `megacpp.infer` (neither
imports the other): device choice, the checkpoint format, the data bundle, evaluation, generation."""
