"""Does the "will compression help?" advice hold? The BERT example on 2 CPU processes, on unshaped loopback and on
bandwidth-limited links, with the estimate CommunicationMonitor logs at the freeze next to the compression-stage step
time it then measures.

Each run is ``python examples/bert_finetune.py fit --config examples/configs/bert_onebit.yaml`` with a fixed
``--freeze-step`` (default 30) and ``--steps`` optimizer steps (default 60), no validation, one torch thread per rank;
the advice (``CompressionAdvice``: median of the last 20 timed warmup steps, then the median of 20 compression-stage
steps from the 3rd) comes from the example's summary JSON. A shaped rate runs the example inside a network namespace
whose loopback is shaped with ``tc tbf`` (the same namespace ``benchmarks/slow_link.py`` uses, deleted
afterwards, also on errors); both ranks' traffic shares that rate. ``unshaped`` runs on the host's loopback.
Results: ``results/advisor.json``.

    python benchmarks/advisor.py                                  # unshaped, 200mbit, 50mbit
    python benchmarks/advisor.py --rates unshaped 100mbit --freeze-step 40 --steps 80
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import write_results  # noqa: E402
from benchmarks.slow_link import shaped_namespace  # noqa: E402


def run_example(rate: str, freeze_step: int, steps: int, workdir: str) -> dict:
    summary = Path(workdir) / f"summary_{rate}.json"
    command = [
        sys.executable, str(ROOT / "examples" / "bert_finetune.py"), "fit",
        "--config", str(ROOT / "examples" / "configs" / "bert_onebit.yaml"),
        "--optimizer.init_args.freeze_step", str(freeze_step), "--optimizer.init_args.auto_freeze", "null",
        "--trainer.max_steps", str(steps), "--trainer.max_epochs", "-1", "--trainer.limit_val_batches", "0",
        "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
        "--summary_json", str(summary),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    with contextlib.ExitStack() as stack:
        if rate != "unshaped":
            netns = stack.enter_context(shaped_namespace(f"onebit_advisor_{os.getpid()}", rate, "256kb", "50ms"))
            command = ["ip", "netns", "exec", netns, *command]
        subprocess.run(command, check=True, cwd=workdir, env=env, timeout=1800)
    return json.loads(summary.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=["unshaped", "200mbit", "50mbit"])
    parser.add_argument("--freeze-step", type=int, default=30)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--name", default="advisor")
    args = parser.parse_args()
    if args.steps < args.freeze_step + 22:
        parser.error("--steps must leave at least 22 compression-stage steps (2 settling, 20 measured)")
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
