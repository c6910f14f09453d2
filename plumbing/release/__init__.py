"""release/: a trained ensemble as the field shares models, and how it is read back.

  layout.py            the release folder: safetensors weights in one folder per network,
                       the JSON index (model_index.json) and its checks, the files it ships
                       for diffusers
  diffusers_format.py  our DiT's weights in diffusers' layout and back (DiT, PixArt-alpha)
  model_card.py        the model card, generated from what the run recorded
  hub_pipeline.py      the diffusers pipeline shipped inside every release; standalone (it
                       imports no plumbing, only the method files shipped beside it), and
                       never imported by this project's own stages

export.py writes releases; the core's checkpoint.py and ensemble.py read a release's
networks and index where a run folder is a release (sample.py, eval.py and distill.py read
them so). It reads nothing else of the plumbing: a release's format stands alone."""
