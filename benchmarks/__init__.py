"""Performance scripts. Each prints ratios against a reference run in the same process; nothing here is
asserted."""
