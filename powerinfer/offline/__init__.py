"""The offline pipeline: profile -> train -> solve -> pack, one module (and main) per step."""
