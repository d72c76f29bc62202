"""Files on disk: atomic writes, generated and replaced folders, checksummed caches, stale temporaries. Imports no
other wing."""
