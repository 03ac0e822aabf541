"""Does the "will compression help?" advice hold? The BERT example on 2 CPU processes, on unshaped loopback and on
bandwidth-limited links, with the estimate CommunicationMonitor logs at the freeze next to the compression-stage step
time it then measures.

Each run is ``python examples/bert_finetune.py fit --config examples/configs/bert_onebit.yaml`` with a fixed
``--freeze-step`` (default 30) and ``--steps`` optimizer steps (default 60), no validation, one torch thread per rank;
the advice (``CompressionAdvice``: median of the last 20 timed warmup steps, then the median of 20 compression-stage
steps from the 3rd) comes from the example's summary JSON. A shaped rate runs the example inside a network namespace
whose loopback is shaped with ``tc tbf`` (``benchmarks.netns.ShapedLoopback``, the namespace ``benchmarks.slow_link``
uses; deleted afterwards with anything still running in it, also on errors, Ctrl-C and SIGTERM; needs root); both
ranks' traffic shares that rate. ``unshaped`` runs on the host's loopback. Results: ``results/advisor.json``.

    python -m benchmarks.advisor                                  # unshaped, 200mbit, 50mbit
    python -m benchmarks.advisor --rates unshaped 100mbit --freeze-step 40 --steps 80
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from pathlib import Path

from benchmarks import netns
from benchmarks.common import EXAMPLE, EXAMPLE_CONFIGS, argument_parser, script_env, write_results


def run_example(rate: str, freeze_step: int, steps: int, workdir: str) -> dict:
    summary = Path(workdir) / f"summary_{rate}.json"
    command = [
        sys.executable, str(EXAMPLE), "fit",
        "--config", str(EXAMPLE_CONFIGS / "bert_onebit.yaml"),
        "--optimizer.init_args.freeze_step", str(freeze_step), "--optimizer.init_args.auto_freeze", "null",
        "--trainer.max_steps", str(steps), "--trainer.max_epochs", "-1", "--trainer.limit_val_batches", "0",
        "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
        "--summary_json", str(summary),
    ]
    env = script_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    with contextlib.ExitStack() as stack:
        space = None if rate == "unshaped" else stack.enter_context(netns.ShapedLoopback("advisor", rate))
        netns.run(command, timeout=1800, inside=space, cwd=workdir, env=env)
    return json.loads(summary.read_text())


def main() -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--rates", nargs="+", default=["unshaped", "200mbit", "50mbit"])
    parser.add_argument("--freeze-step", type=int, default=30)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--name", default="advisor")
    args = parser.parse_args()
    if args.steps < args.freeze_step + 22:
        parser.error("--steps must leave at least 22 compression-stage steps (2 settling, 20 measured)")
    if any(rate != "unshaped" for rate in args.rates) and netns.problems():
        parser.error(f"shaped rates: {'; '.join(netns.problems())} (--rates unshaped needs neither)")
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for rate in args.rates:
            summary = run_example(rate, args.freeze_step, args.steps, workdir)
            advice = summary.get("advice")
            if advice is None or advice.get("measured_step_s") is None:
                raise RuntimeError(f"{rate}: the example's summary holds no measured advice: {summary}")
            rows.append(dict(rate=rate, **advice))
            print(f"{rate}: warmup {advice['step_s']:.3f} s (exposed {advice['exposed_s']:.3f} s), "
                  f"expected {advice['expected_step_s']:.3f} s, measured {advice['measured_step_s']:.3f} s", flush=True)
    payload = dict(
        config=dict(example="examples/configs/bert_onebit.yaml", ranks=2, freeze_step=args.freeze_step,
                    steps=args.steps, rates=args.rates),
        rows=rows,
    )
    print(f"written to {write_results(args.name, payload)}")


if __name__ == "__main__":
    main()
