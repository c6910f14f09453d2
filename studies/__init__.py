"""The studies behind docs/results.md, one module per `reproduce.py --part`; what they
share is in common.py, and provenance.py asks the git history where a declared test's
chunks came from.

Stages never import a study: the studies sit on top of the stages' command lines.
"""
