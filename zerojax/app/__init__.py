"""The training application behind `python -m zerojax`: command dispatch (`cli`), options
and data, the training loop, its progress report, sampling, and GPU overlap flags."""
