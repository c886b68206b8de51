"""glmport.rl: GLM-5's post-training RL on the tiny GLM-5 of :mod:`glmport.model`.

- :mod:`~glmport.rl.losses`: GRPO advantages, the PPO clip with IcePop, GLM-5's
  normalisation, double-sided importance sampling, on-policy distillation, KL terms.
- :mod:`~glmport.rl.tasks`: verifiable toy tasks (digit reversal, addition).
- :mod:`~glmport.rl.config`: what defines a run (``RLConfig``, the policy's config).
- :mod:`~glmport.rl.trainer`: the synchronous trainer (rollout and training on any
  backends and dtypes, the mismatch measured every step, choice replay);
  :mod:`~glmport.rl.checkpoint` (its checkpoints, written and checked),
  :mod:`~glmport.rl.seeding` (each step's random draws).
- :mod:`~glmport.rl.async_trainer`: asynchronous RL on Ray (rollout workers sampling
  continuously, AReaL's staleness bound, double-sided importance sampling, restarts);
  :mod:`~glmport.rl.workers` (the rollout worker), :mod:`~glmport.rl.staleness` (the
  capacity rule and the group ledger), :mod:`~glmport.rl.ray_runtime` (Ray itself).
- :mod:`~glmport.rl.run` / :mod:`~glmport.rl.report`: a run's progress bar, metrics
  and curves (``glmport rl train``).

Importing this package imports no optional dependency; rich and matplotlib (the
``rl`` extra) load when a run draws its progress bar or curves, Ray when a run or the
gateway asks for it.
"""
