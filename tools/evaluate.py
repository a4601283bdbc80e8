"""`python tools/evaluate.py ...` is `shatter-evaluate ...` (train/evaluate_cli.py), for a checkout
used without its console scripts on PATH."""

from shatter.train.evaluate_cli import main

if __name__ == "__main__":
    from shatter.train.lifecycle import run_cli

    run_cli(main)
