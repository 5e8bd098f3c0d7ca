"""Hidden setup of docs/cli.md's "Rebuild the found model in Python": a finished run
directory ``runs/x`` of the default task and model (MNIST, ResNet-20 at width 8), made small."""

import subprocess

subprocess.run(["dmscale", "search", "--train-limit", "512", "--test-limit", "256", "--batch-size", "64",
                "--retrain-epochs", "0", "--quiet", "--out", "runs/x"], check=True)
