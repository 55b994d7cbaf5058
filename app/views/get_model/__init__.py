"""The "Get a model..." dialog (dialog.py): models from the Hugging Face Hub, found, checked
(what fits here) and downloaded into the Hugging Face cache. A dialog the screens open (the
New run screen's model picker): below the screens, above widgets; it uses the engine through
app.engine.api only."""
