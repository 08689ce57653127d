"""Training: the state and the jitted step, losses, gradient caching, distillation, optimizers, checkpoints, preemption, sizing, metric logs."""
