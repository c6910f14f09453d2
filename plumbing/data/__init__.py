"""data/: the images every stage reads, whatever form they come in.

  datasets.py  the data sets of --data (digits, Fashion-MNIST, CIFAR-10, ImageNet-64, an
               image folder, shards), held as uint8, and the batches a trainer draws
  files.py     the on-disk formats they come in (CIFAR-10's pickles, IDX, npz batches)
  shards.py    WebDataset shard sets (--data wds:PATTERN), read by position
  islands.py   writing shard sets, and each cluster's shards for an island that holds only them
  latents.py   SD-VAE latents: the VAE, and the cache of a data set's latents (--vae)
  encoders.py  frozen pretrained encoders: open_clip's towers, the caption cache, DINOv2
  features.py  what cluster.py clusters by (pixels' PCA, CLIP, DINOv2, captions), cached

Read by every stage; it reads only the core's command line and run folder (run_dir.py),
never another wing."""
