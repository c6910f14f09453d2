"""The plumbing every stage shares and a learner can skip: command line, run folders,
checkpoints, data sets and shards, conditions and encoders, latents, releases and the
diffusers layout.

The method itself is in the top-level diffusion.py and routing.py, the networks in
model.py."""
