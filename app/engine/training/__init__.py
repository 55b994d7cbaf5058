"""Training: TrainConfig and the run-config schema, optimizers, the session (one step), the
supervised loop, GRPO, reward functions and checkpoints.

May import: `data`, `model`, `text`, `io`, `kernels`, `runtime`, `errors`. Never `runs` or
`export`: a loop reports through the control object it is given.
"""
