"""release/: a trained ensemble as the field shares models, and how it is read back.

  layout.py            the release folder: safetensors weights in one folder per network,
                       the JSON index (model_index.json), the files it ships for diffusers
  reader.py            the one checked reader of a release (index, network records,
                       constructor arguments, weights, the text tower), for this project's
                       stages and the shipped pipeline alike
  diffusers_format.py  our DiT's weights in diffusers' layout and back (DiT, PixArt-alpha)
  model_card.py        the model card, generated from what the run recorded
  hub_pipeline.py      the diffusers pipeline shipped inside every release, and
  hub_components.py    its components (experts, router, text tower); both standalone (they
                       import only the method files, reader.py and diffusers_format.py,
                       shipped beside them), never imported by this project's own stages

export.py writes releases; the core's checkpoint.py and ensemble.py read a release's
networks and index through reader.py where a run folder is a release (sample.py, eval.py
and distill.py read them so). It reads nothing else of the plumbing: a release's format
stands alone."""
