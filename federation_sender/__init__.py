"""federation-sender: a standalone Matrix federation sender worker."""
