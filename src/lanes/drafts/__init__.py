"""lanes.drafts: where drafts come from (the lane core's `DraftSource`s): n-grams of a stream's own context,
a suffix index of it and of recent outputs, and a small draft model."""
