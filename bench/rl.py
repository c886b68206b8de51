"""RL throughput of the tiny reverse-task policy on this CPU: glmport against the
transformers baseline an RL user would otherwise run, side by side in one run.

The policy is ``policy_config(make_task("reverse", digits=4), {})`` (seed 0); a batch
is 32 prompts x 8 samples (256 sequences, prompts of 5 tokens, 4 new tokens). Every
case below runs interleaved with the others (round ``i`` of each is sample ``i``), at
each torch thread count, on the generic backend with the default (full) validation.

1. Rollout tokens/s: glmport ``generate`` sampling with ``return_logprobs``; the same
   with ``record_choices`` (the replay record's cost); transformers'
   ``GlmMoeDsaForCausalLM.generate(do_sample=True, output_logits=True)`` with the same
   weights and the sampled tokens' log-probs from ``log_softmax`` of its logits.
2. Training tokens/s (forward + backward of the response log-probs' sum): glmport
   ``continuation_logprobs``; the same replaying the rollout's choices; transformers'
   forward on prompt + response (without the last token, whose logits score nothing,
   as glmport), ``log_softmax``, gather of the response tokens.
3. One whole ``Trainer.step()`` (generic rollout and training, 32 x 8, 2 minibatches):
   seconds, and the rollout / train tokens/s the trainer reports.

Also checked: for the same tokens (sampled by transformers), glmport's
``continuation_logprobs`` and transformers' ``log_softmax`` gather agree
(``logprob_agreement_max_abs``), and so do glmport's rollout log-probs and a
transformers forward on glmport's samples (``rollout_logprob_agreement_max_abs``).

Run: ``python bench/rl.py`` (a few minutes on 2 cores); writes ``bench/results/rl.json``
(``--out PATH`` elsewhere) and prints the table. ``--smoke --out PATH``: 4 prompts x 2,
one repeat, one thread (timings mean nothing; never written to ``bench/results``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its helpers

from common import RESULTS, environment, interleaved_samples, save, spread, table

import glmport
from glmport.model import GlmMoeDsaForCausalLM
from glmport.model.generation import GenerationResult, generate
from glmport.model.scoring import continuation_logprobs
from glmport.rl.tasks import make_task
from glmport.rl.trainer import RLConfig, Trainer, policy_config

BACKEND = "generic"
ROLLOUT_SEED = 1


@dataclass
class Setup:
    """The policy, its transformers twin and one batch of prompts with a rollout."""

    policy: GlmMoeDsaForCausalLM
    hf: torch.nn.Module
    prompts: list[list[int]]
    new_tokens: int
    rollout: GenerationResult | None = None


def hf_twin(policy: GlmMoeDsaForCausalLM) -> torch.nn.Module:
    """transformers' ``GlmMoeDsaForCausalLM`` with ``policy``'s weights (through an HF
    checkpoint, as a user would load it), eager attention, fp32."""
    import transformers

    transformers.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as folder:
        policy.save_pretrained(folder)
        hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(
            folder, attn_implementation="eager", dtype=torch.float32
        )
    return hf.eval()


def ours_rollout(s: Setup, record: bool) -> GenerationResult:
    """glmport sampling with per-token log-probs (and the choice record)."""
    with glmport.use_backend(BACKEND), torch.no_grad():
        return generate(
            s.policy,
            s.prompts,
            s.new_tokens,
            greedy=False,
            seed=ROLLOUT_SEED,
            return_logprobs=True,
            record_choices=record,
        )


def hf_rollout(s: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers sampling: the new tokens ``[B, N]`` int64 and their log-probs
    ``[B, N]`` fp32 from ``log_softmax`` of the returned (unprocessed) logits."""
    ids = torch.tensor(s.prompts)
    torch.manual_seed(ROLLOUT_SEED)
    with torch.no_grad():
        out = s.hf.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            max_new_tokens=s.new_tokens,
            min_new_tokens=s.new_tokens,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,  # the checkpoint's eos (1) is a digit here: no stop token
        )
        tokens = out.sequences[:, ids.shape[1] :]
        logits = torch.stack(out.logits, dim=1).float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None])[..., 0]
    return tokens, logp


def ours_train(s: Setup, replay: bool) -> None:
    """Forward + backward of the sum of the rollout's response log-probs (glmport)."""
    s.policy.zero_grad(set_to_none=True)
    with glmport.use_backend(BACKEND):
        scores = continuation_logprobs(
            s.policy,
            s.prompts,
            s.rollout.output_ids,
            replay=s.rollout.choices if replay else None,
        )
        scores.logprobs.sum().backward()


def hf_response_logprobs(s: Setup, responses: list[list[int]]) -> torch.Tensor:
    """transformers' log-probs ``[B, N]`` fp32 of ``responses`` after the prompts: one
    forward on the consumed tokens (prompt + response but its last token)."""
    full = torch.tensor([[*p, *r] for p, r in zip(s.prompts, responses, strict=True)])
    start = len(s.prompts[0]) - 1
    consumed = full[:, :-1]
    logits = s.hf(input_ids=consumed, attention_mask=torch.ones_like(consumed)).logits
    logp = torch.log_softmax(logits[:, start:].float(), dim=-1)
    return logp.gather(-1, full[:, start + 1 :, None])[..., 0]


def hf_train(s: Setup) -> None:
    s.hf.zero_grad(set_to_none=True)
    hf_response_logprobs(s, s.rollout.output_ids).sum().backward()


def agreement(s: Setup) -> dict[str, float]:
    """Max abs log-prob differences between glmport and transformers on the same tokens."""
    tokens, hf_logp = hf_rollout(s)
    with glmport.use_backend(BACKEND), torch.no_grad():
        ours = continuation_logprobs(s.policy, s.prompts, tokens.tolist()).logprobs
        replayed = hf_response_logprobs(s, s.rollout.output_ids)
    rollout_logp = torch.stack(s.rollout.logprobs)
    return {
        "logprob_agreement_max_abs": float((ours - hf_logp).abs().max()),
        "rollout_logprob_agreement_max_abs": float((rollout_logp - replayed).abs().max()),
    }


def rate_row(section: str, name: str, threads: int, tokens: int, seconds: list[float]) -> dict:
    rates = [tokens / t for t in seconds]
    return {
        "section": section,
        "name": name,
        "threads": threads,
        "tokens": tokens,
        "samples_s": seconds,
        "tokens_per_s": rates,
        **{f"{k}_tokens_per_s": v for k, v in spread(rates).items()},
    }


def with_ratios(rows: list[dict], baseline: str) -> list[dict]:
    """Each row's median tokens/s over the baseline row's at its thread count."""
    base = {r["threads"]: r["median_tokens_per_s"] for r in rows if r["name"] == baseline}
    for r in rows:
        r["vs_hf"] = r["median_tokens_per_s"] / base[r["threads"]]
    return rows


ROLLOUT = {
    "glmport generate + logprobs": "ours",
    "glmport generate + logprobs + choices": "ours_record",
    "transformers generate + log_softmax": "hf",
}
TRAINING = {
    "glmport continuation_logprobs": "ours",
    "glmport continuation_logprobs, replayed choices": "ours_replay",
    "transformers forward + log_softmax gather": "hf",
}
HF_ROLLOUT, HF_TRAINING = list(ROLLOUT)[-1], list(TRAINING)[-1]


def bench_threads(s: Setup, trainer: Trainer, threads: int, repeats: int) -> dict[str, list]:
    """Every case at ``threads`` torch threads, interleaved ``repeats`` times."""
    torch.set_num_threads(threads)
    step_metrics: list[dict] = []
    fns: dict[str, Callable[[], object]] = {
        "rollout/ours": lambda: ours_rollout(s, record=False),
        "rollout/ours_record": lambda: ours_rollout(s, record=True),
        "rollout/hf": lambda: hf_rollout(s),
        "training/ours": lambda: ours_train(s, replay=False),
        "training/ours_replay": lambda: ours_train(s, replay=True),
        "training/hf": lambda: hf_train(s),
        "trainer_step": lambda: step_metrics.append(trainer.step()),
    }
    samples = interleaved_samples(fns, repeats)
    tokens = len(s.prompts) * s.new_tokens
    rollout = [
        rate_row("rollout", name, threads, tokens, samples[f"rollout/{key}"])
        for name, key in ROLLOUT.items()
    ]
    training = [
        rate_row("training", name, threads, tokens, samples[f"training/{key}"])
        for name, key in TRAINING.items()
    ]
    measured = step_metrics[-repeats:]  # the first step was the warm-up
    step = {
        "section": "trainer_step",
        "name": "Trainer.step()",
        "threads": threads,
        "samples_s": samples["trainer_step"],
        **{f"{k}_s": v for k, v in spread(samples["trainer_step"]).items()},
    }
    for key in ("rollout_tokens_per_s", "train_tokens_per_s"):
        values = [m[key] for m in measured]
        step[key] = values
        step.update({f"{k}_{key}": v for k, v in spread(values).items()})
    return {
        "rollout": with_ratios(rollout, HF_ROLLOUT),
        "training": with_ratios(training, HF_TRAINING),
        "trainer_step": [step],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="4 prompts x 2, 1 repeat, 1 thread")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default rl.json)")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per thread count")
    args = parser.parse_args(argv)
    try:
        args.threads = [int(t) for t in args.threads.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--threads takes comma-separated ints, got {args.threads!r}")
    if not args.threads or min(args.threads) < 1:
        parser.error(f"--threads takes thread counts >= 1, got {args.threads}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.smoke:
        if args.out is None or args.out.resolve().is_relative_to(RESULTS):
            parser.error(
                "--smoke needs --out PATH outside bench/results (smoke timings mean nothing)"
            )
        args.threads, args.repeats = [1], 1
    args.out = args.out or RESULTS / "rl.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts_n, group = (4, 2) if args.smoke else (32, 8)
    task = make_task("reverse", digits=4)
    policy = GlmMoeDsaForCausalLM.from_config(policy_config(task, {}), seed=0)
    problems = task.sample(prompts_n, torch.Generator().manual_seed(0))
    prompts = [list(p.prompt) for p in problems for _ in range(group)]
    s = Setup(policy, hf_twin(policy), prompts, task.response_len)
    s.rollout = ours_rollout(s, record=True)
    trainer = Trainer(
        RLConfig(
            rollout_backend=BACKEND,
            train_backend=BACKEND,
            prompts_per_step=prompts_n,
            group_size=group,
        )
    )
    import transformers

    payload: dict = {
        "command": "python bench/rl.py" + (" --smoke" if args.smoke else ""),
        "smoke": args.smoke,
        "backend": BACKEND,
        "batch": {"prompts": prompts_n, "samples_per_prompt": group, "sequences": len(prompts)},
        "prompt_tokens": task.prompt_len,
        "new_tokens": task.response_len,
        "repeats": args.repeats,
        "threads": args.threads,
        "transformers": transformers.__version__,
        **agreement(s),
        "rollout": [],
        "training": [],
        "trainer_step": [],
    }
    default_threads = torch.get_num_threads()
    for threads in args.threads:
        print(f"[{threads} thread{'s' if threads > 1 else ''}]", flush=True)
        for section, rows in bench_threads(s, trainer, threads, args.repeats).items():
            payload[section] += rows
    torch.set_num_threads(default_threads)  # the environment records the process default
    save(args.out, {"environment": environment(), **payload})
    print_tables(payload)
    return 0


def print_tables(p: dict) -> None:
    batch = p["batch"]
    print(
        f"\nReverse-task policy, {batch['prompts']} prompts x {batch['samples_per_prompt']}, "
        f"{p['prompt_tokens']}-token prompts, {p['new_tokens']} new tokens, {BACKEND} backend; "
        f"medians of {p['repeats']} interleaved rounds (min-max)"
    )
    rows = [("section", "case", "threads", "tokens/s", "min-max", "vs HF")]
    for r in p["rollout"] + p["training"]:
        rows.append((
            r["section"], r["name"], r["threads"], f"{r['median_tokens_per_s']:.0f}",
            f"{r['min_tokens_per_s']:.0f}-{r['max_tokens_per_s']:.0f}", f"{r['vs_hf']:.2f}x",
        ))  # fmt: skip
    print(table(rows))
    print("\nTrainer.step() (rollout + old log-probs + 2 minibatch updates)")
    rows = [("threads", "s/step", "min-max", "rollout tok/s", "train tok/s")]
    for r in p["trainer_step"]:
        rows.append((
            r["threads"], f"{r['median_s']:.2f}", f"{r['min_s']:.2f}-{r['max_s']:.2f}",
            f"{r['median_rollout_tokens_per_s']:.0f}", f"{r['median_train_tokens_per_s']:.0f}",
        ))  # fmt: skip
    print(table(rows))
    print(
        f"\nlog-prob agreement with transformers (max abs): same tokens "
        f"{p['logprob_agreement_max_abs']:.2e}, rollout log-probs "
        f"{p['rollout_logprob_agreement_max_abs']:.2e}"
    )


if __name__ == "__main__":
    sys.exit(main())
