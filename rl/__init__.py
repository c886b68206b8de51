"""glmport.rl: GRPO with IcePop, asynchronous RL with double-sided importance
sampling, on-policy distillation. Not built yet."""
