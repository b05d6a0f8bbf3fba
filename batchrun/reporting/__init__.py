"""What `batchrun stats` and `batchrun report` say about an output directory."""
