"""`python -m hybrid_ray.lm --config JOB.json`: what torchrun runs on every rank."""
import sys

from hybrid_ray.lm.launch import main

sys.exit(main(prog="python -m hybrid_ray.lm"))
