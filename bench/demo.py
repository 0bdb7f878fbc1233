"""The elastic demo's figures (scripts/demo/elastic.py, what scripts/demo.sh runs) as JSON:
three agents on one local etcd, --nnodes 2:3, one fsdp-trainer worker each; node 2 is
SIGKILLed and comes back, node 1 is SIGTERMed (a pod delete) and comes back.

The demo itself runs unchanged (imported, its narration sent to stderr); this prints one
JSON object on stdout: per event the step it came at, how long the survivors took to
re-form (agent timestamps) and to train again (the first step the resumed group logs), the
world sizes, the checkpoint resumed from and the steps redone; the model's parameters;
every agent's exit code.

usage: python bench/demo.py --agent target/release/fsdp-agent --trainer target/release/fsdp-trainer
                            [--steps 800]
"""
import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_demo():
    # By path: scripts/demo is no package, and bench/ has an elastic.py of its own.
    spec = importlib.util.spec_from_file_location("demo_elastic", os.path.join(ROOT, "scripts/demo/elastic.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--agent", required=True)
    ap.add_argument("--trainer", required=True)
    ap.add_argument("--steps", type=int, default=800)
    a = ap.parse_args()
    a.workdir = None
    demo = load_demo().Demo(a)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            demo.run()
        params = next((int(m.group(1)) for l in demo.trainer_lines() for m in [re.search(r"Model: (\d+) parameters", l)]
                       if m), None)
        out = {"steps": demo.steps, "ckpt_every": demo.ckpt_every, "params": params,
               "codes": {str(n.index): n.proc.returncode for n in demo.nodes},
               "events": [{"event": label, "at_step": at, "reformed_s": took, "training_s": training, "world": world,
                           "resumed_from": resumed, "redone": lost}
                          for label, at, took, training, world, resumed, lost in demo.events]}
    finally:
        with contextlib.redirect_stdout(sys.stderr):
            demo.cleanup()
        shutil.rmtree(demo.workdir, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
