"""These are vendored DeepSpeed scripts that tests/distributed/test_deepspeed_scripts.py runs as
subprocesses. They are not test modules, even where a name such as ds_stage3_test.py matches
pytest's pattern, and importing one starts its training."""
collect_ignore_glob = ["*.py"]
