"""The studies behind docs/results.md, one module per `reproduce.py --part`; what they
share is in common.py.

Stages never import a study: the studies sit on top of the stages' command lines.
"""
