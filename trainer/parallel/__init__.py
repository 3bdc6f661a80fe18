"""The parallel layout: the world's process groups and what data-parallel ranks exchange."""
