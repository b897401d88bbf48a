"""The run plan: what the floors above the config decide from it and the host before any rank
starts (the checked flags, the data's vocabulary, the layer split)."""
