"""The language-model job: a GPT trained by the engine on a prepared token dataset.

    jobs/train_lm.py --config jobs/configs/small_cpu.json    # or: hybrid-ray train CONFIG

job.py reads the job file; setup.py prepares the data (hybrid_ray.data) and builds model, engine
and loader; loop.py trains (one rank, called the same way by torchrun and by Ray workers);
evaluate.py holds validation loss and sampling; launch.py validates and starts the ranks with
torchrun or on Ray; elastic.py is the job's Ray driver, router.py routes its workers' records,
worker.py is what each Ray worker runs; prepare_main.py is jobs/prepare_data.py.
"""
