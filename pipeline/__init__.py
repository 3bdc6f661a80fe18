"""The main job: the whole pipeline as local processes, on embedded defaults."""
