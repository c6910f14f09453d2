"""The plumbing every stage shares and a learner can skip. The method itself is in the
top-level diffusion.py and routing.py, the networks in model.py.

A small core, read by every stage:

  command_line.py  one-line errors, flag types that refuse bad values where they are parsed
  run_dir.py       the runs/ folder: its layout, atomic writes, locks
  distributed.py   the process layout under torchrun (training and sampling split over it)
  checkpoint.py    a trained network from its file (ours, a release's, DiT's) and its digest
  condition.py     what a network is conditioned on: nothing, a class, a caption
  sources.py       where an expert's images come from: a cluster, an island, a contribution
  ensemble.py      the experts and router of a run folder, checked to belong together

and wings, one sub-package per concern, each read only by the stages that need it:

  data/        the data sets and their formats, shards and islands, latents, encoders
  training/    the step, its log, its cost and precision, the plan and resume check, --init
  router/      what train_router.py learns from: data, the experts' samples; its size
  evaluation/  eval.py's measures, its judge and Inception
  release/     the release folder, its checked reader, diffusers' layout, the card, the pipeline

The rules (tests/test_design.py holds them): the wings import the core and data/, never
each other otherwise; data/ reads only command_line.py and run_dir.py of the core;
release/ reads no plumbing at all, and of the core only checkpoint.py and ensemble.py read
it (a run folder may be a release); evaluation/ is eval.py's, router/ train_router.py's."""
