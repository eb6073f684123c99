"""What every layer reads: settings, options, fp8 recipes, argument checks, auto's rule."""
