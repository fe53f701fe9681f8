"""The command-line entry points, `python -m launch.NAME` (see each module's docstring).

Importing the package first prepares JAX's start for them (`launch/jax_env.py`)."""

from launch import jax_env

jax_env.prepare()
