"""router/: what train_router.py needs beyond the core, and no other stage reads.

  data.py     what a router learns from data: each part of the data with the expert its
              images belong to (the clusters, and every contributor this machine can read)
  samples.py  the same parts made of the experts' own samples, when nobody's data may be read
  size.py     how large a router is (the size rule, --model) and where it starts (--init)

It reads the core and data/."""
