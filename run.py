#!/usr/bin/env python
"""``python run.py [overrides]``: the same as ``kvnotes run [overrides]`` (:mod:`kvnotes.cli.run`).

    python run.py                                   # blast_radius on the embedded SmolLM2-135M
    python run.py model=qwen3-8b probe=screen       # a hub model (GPU)
    python run.py -m model=smollm2-135m probe=blast_radius,screen   # one record per job
"""

from kvnotes.cli.run import main

if __name__ == "__main__":
    main()
