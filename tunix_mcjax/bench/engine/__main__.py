"""`python -m tunix_mcjax.bench.engine`: see `cli`."""

from tunix_mcjax.bench.engine.cli import main

if __name__ == "__main__":
    main()
