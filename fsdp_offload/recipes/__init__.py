"""The Hydra recipes (a package, so that an installed wheel carries them and Hydra finds them)."""
