"""`python tools/glue.py ...` is `shatter-glue ...` (train/finetuning/glue_suite.py), for a
checkout used without its console scripts on PATH."""

from shatter.train.finetuning.glue_suite import main

if __name__ == "__main__":
    main()
