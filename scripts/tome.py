"""ToMe (token merging) for the AUTOMATIC1111 / Forge / reForge WebUI: entry point only.

The WebUI imports scripts/*.py by path with this extension's folder on sys.path only during that
import, so everything is imported here, at the top. The logic lives in tome_webui/ and tome_core/.
"""
import gradio as gr

from modules import script_callbacks, scripts, shared

from tome_webui import runner, settings, ui, xyz


class ToMeScript(scripts.Script):
    sorting_priority = 15

    def title(self):
        return "ToMe"

    def show(self, is_img2img):
        return scripts.AlwaysVisible

    def ui(self, is_img2img):
        try:
            from modules.ui_components import InputAccordion
        except ImportError:  # a WebUI older than InputAccordion
            InputAccordion = None
        return ui.build(self, is_img2img, settings.defaults(shared.opts), gr, InputAccordion,
                        forge=runner.forge_installed())

    def process(self, p, *args):
        runner.start(p, args)

    def process_batch(self, p, *args, **kwargs):
        runner.before_batch(p)

    def before_hr(self, p, *args):
        runner.before_hr(p)

    def process_before_every_sampling(self, p, *args, **kwargs):  # Forge / reForge
        runner.before_sampling(p)

    def postprocess_batch(self, p, *args, **kwargs):
        runner.after_batch(p)

    def postprocess(self, p, processed, *args):
        runner.finish(p)


script_callbacks.on_ui_settings(lambda: settings.add_settings(shared, gr))
script_callbacks.on_before_ui(lambda: xyz.register(
    scripts.scripts_data, [getattr(scripts, name, None) for name in ("scripts_txt2img", "scripts_img2img")]))
