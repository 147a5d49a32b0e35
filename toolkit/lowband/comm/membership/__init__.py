"""Membership and trust: who is in the run and what a peer may hand over.

fixed.py (a plain run's membership: every group, always), elastic.py (torchft groups: quorums,
commits, heals; `membership` picks the one a run has), heal.py (a joining group's state, sent
weights-only with a MAC), lives.py (a group's restarts), bind.py (which address each service
listens on), secret.py (the run's shared secret)."""
