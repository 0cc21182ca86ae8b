"""``specdec bench``: speed and exactness of speculative decoding against its baselines.

Layers: :mod:`workloads` (question files, task groups), :mod:`methods` (our engine and the
Hugging Face baselines behind one runner protocol), :mod:`harness` (warm-up, interleaved runs,
records), :mod:`stats` (pure statistics), :mod:`report` (markdown and plots). The CLI in
:mod:`specdec.cli.bench` draws progress and writes files; nothing here prints.
"""
