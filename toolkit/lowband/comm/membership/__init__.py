"""Membership and trust: who is in the run and what a peer may hand over.

elastic.py (torchft groups: quorums, commits, the fixed membership of a plain run), heal.py (a
joining group's state, sent weights-only with a MAC), lives.py (a group's restarts), bind.py
(which address each service listens on), secret.py (the run's shared secret)."""
