"""evaluation/: what eval.py measures with, and no other stage reads.

  metrics.py    the measures as functions of feature arrays: Frechet distance, precision and
                recall, KID, diversity, memorisation, the floor
  judge.py      the evaluation classifier that gives small images their feature space, and
                the copies shipped in judges/ so that every machine scores alike
  inception.py  FID's Inception-v3 and its weights
  reference.py  the real images' statistics and each N's floor, cached and checked when read
                back

It reads the core and data/."""
