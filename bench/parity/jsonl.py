"""The JSON-lines reader the bench summaries share (imported from their own directory)."""
import json
import os


def json_lines(path):
    """Every line of `path` that parses as a JSON object, in order; [] when the file is absent."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    return out
