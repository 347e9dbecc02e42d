"""Out-of-memory auto-fit, behind one seam.

- `supervisor`: `megacpp train` on CUDA runs the training as child attempts and retries a warmup
  out-of-memory error with half the micro-batch;
- `attempt`: the training process's side (the `Attempt` the Trainer holds), the micro-batch arithmetic
  and the out-of-memory report;
- `child_output`: a child's output streamed to the terminal, logged, and its tail kept;
- `rendezvous`: the torchrun job's store, where the attempts' process groups meet and ranks agree to retry.

The Trainer sees only `attempt.Attempt`; nothing else in megacpp imports this package but the CLI.
"""
