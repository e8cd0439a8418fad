"""Speculative decoding: proposers (n-gram, draft model), the speculation-length policy and the
acceptance counters. Verification is the target's forward over the drafts in the scheduler's
one loop; worker/rejection_sampler.py keeps the target distribution."""
