"""Long prompts under the hot set: accuracy, speed, capacity, drift and the bound; see RESULTS.md."""
