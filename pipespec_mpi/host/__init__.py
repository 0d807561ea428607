"""The CPU host's machinery, apart from the protocol: which CPU code paths a rank runs and checks
(dispatch.py), the doorbell a waiting rank sleeps on (doorbell.py), sleeping waits with backoff
(wait.py), and each rank's threads and CPUs on its node (placement.py). Whether it applies is the
device seam's call (platforms.py); stage/ and speculative/ never import it."""
