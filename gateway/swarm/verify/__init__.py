"""Checking that nodes compute what they should: probation at join, spot checks while serving, receipts, trust.

view (new peer) ─▶ probation.challenge ─▶ TrustBook ◀── spot_checks (sampled real steps, off the token path)
                                             │
                      router: who may be routed, in which order (reputation)
"""
