"""A release's model card (README.md): the Hugging Face Hub's YAML front matter (library,
pipeline tag, licence, tags, data set, base model and the measured results), then what the
ensemble is, how it was trained, what was measured and how to sample it, all generated
from the records the run kept."""
import json

# the Hub's ids of the data sets --data names, and their licences, where known
HUB_DATASETS = {"fashion-mnist": ("zalando-datasets/fashion_mnist", "MIT"),
                "mnist": ("ylecun/mnist", "CC BY-SA 3.0"),
                "cifar10": ("uoft-cs/cifar10", "unknown"),
                "digits": (None, "CC BY 4.0 (UCI optical recognition of handwritten digits)")}


def front_matter(index, license, base_model):
    """The YAML block the Hub indexes a model by (written as JSON values: YAML reads them)."""
    kind = (index.get("data_spec") or "").split(":")[0]
    dataset, _ = HUB_DATASETS.get(kind, (None, None))
    text = index["condition"]["kind"] == "text"
    meta = {"license": license, "library_name": "diffusers",
            "pipeline_tag": "text-to-image" if text else "unconditional-image-generation",
            "tags": ["decentralized-diffusion", "mixture-of-experts", "dit", "rectified-flow",
                     *(["class-conditional"] if index["condition"]["kind"] == "class" else [])]}
    if dataset:
        meta["datasets"] = [dataset]
    if base_model:
        meta["base_model"] = base_model
    results = [{"task": {"type": meta["pipeline_tag"]},
                "dataset": {"name": index.get("data_spec") or "?", "type": dataset or kind},
                "metrics": [{"type": "fd", "value": round(m["fd_classifier"], 4),
                             "name": f"FD in the evaluation classifier's features, N = {m['n']}, "
                                     f"{m['batch']}"}]} for m in index["measured"]]
    if results:
        meta["model-index"] = [{"name": index["name"], "results": results}]
    return ["---", *(f"{key}: {json.dumps(value)}" for key, value in meta.items()), "---", ""]


def data_licence(index):
    kind = (index.get("data_spec") or "").split(":")[0]
    licence = HUB_DATASETS.get(kind, (None, None))[1]
    return (f"Training data: `{index.get('data_spec')}`"
            + (f", licensed {licence}." if licence else " (its licence: see its source)."))


def example_request(index):
    if index["condition"]["kind"] == "class":
        return f"class_labels={list(range(min(4, index['condition']['num_classes'])))}"
    if index["condition"]["kind"] == "text":
        return 'prompt=["a photograph of a cat"], negative_prompt="blurry", guidance_scale=3.0'
    return "num_images=4"


# diffusers before 0.38 let a Hub repository run code without trust_remote_code
ADVISORIES = "CVE-2026-44513, CVE-2026-44827 and CVE-2026-45804"


def kind_of_release(index):
    """What the pipeline loads this release as, in words, and what it needs installed."""
    kind = {"class": "class-conditional", "text": "text-to-image",
            "none": "unconditional"}.get(index["condition"]["kind"], index["condition"]["kind"])
    space = "latent (its VAE is the `vae` component)" if index.get("vae") else "pixel"
    model = ("a routed ensemble of " + str(len(index["experts"])) + " experts"
             if index.get("router") else "one model, no router")
    extra = " and open_clip_torch (its text tower is the `text_encoder` component)" \
        if index["condition"]["kind"] == "text" else ""
    return f"a {kind} {space} release, {model}; it needs diffusers 0.38 or newer{extra}"


def describe_condition(spec):
    if spec["kind"] == "class":
        return f"class labels ({spec['num_classes']} classes)"
    return f"captions ({spec.get('encoder')})" if spec["kind"] == "text" else "none"


def describe_source(source):
    earlier = source["releases"][:-1]
    return (f"trained in {source['trained_in']} ({source['steps']} steps)"
            + (f", taken from release {', '.join(earlier)}" if earlier else ""))


def model_card(index, license="other", base_model=None):
    """README.md of a release: the Hub's front matter, then what it is, how it was trained,
    what was measured, how to use it."""
    experts = index["experts"]
    data = index.get("data") or {}
    lines = [*front_matter(index, license, base_model),
             f"# {index['name']}: a decentralized diffusion ensemble", "",
             f"{len(experts)} experts, each trained alone on its share of "
             f"{data.get('name', 'its data')} (N = {data.get('n', '?')}), and a router "
             "that predicts which share a noisy sample came from "
             "([DDM](https://arxiv.org/abs/2501.05450)). Written by this project's "
             "`export.py`.",
             "", data_licence(index), "",
             "| expert | objective | images | training TFLOPs | source "
             "|", "|---|---|---|---|---|"]
    for e in experts:
        lines.append(f"| {e['name']} | {e['objective']['name']} | {e.get('size', '?')} | "
                     f"{(e.get('flops') or 0) / 1e12:.3f} | "
                     f"{describe_source(e['source'])} |")
    flops = index["training_flops"]
    lines += ["", "Router: "
              f"{'none' if not index.get('router') else index['router']['model']}; "
              f"default routing `{index['routing']}`. Condition: "
              f"{describe_condition(index['condition'])}. Space: "
              f"{'pixels' if not index.get('vae') else 'VAE latents ' + index['vae']['path']}. "
              f"Training FLOPs in all: {flops['total'] / 1e12:.3f} TFLOPs (experts "
              f"{flops['experts'] / 1e12:.3f}, router {flops['router'] / 1e12:.3f}).", "",
              "## Measured", ""]
    if index["measured"]:
        lines += ["| batch | N | FD (classifier features) | requested class | sampling "
                  "cost per image (router included) | command "
                  "|", "|---|---|---|---|---|---|"]
        for m in index["measured"]:
            acc, ratio = m.get("conditional_accuracy"), m.get("cost_vs_one_expert")
            gflops = m.get("sampling_gflops")
            cost = "–" if ratio is None or gflops is None else \
                f"{gflops:.3g} GFLOPs, {ratio:.2f}x one expert"
            lines.append(f"| {m['batch']} | {m['n']} | {m['fd_classifier']:.2f} | "
                         f"{'–' if acc is None else f'{acc:.1%}'} | {cost} | "
                         f"`{m['command']}` |")
        lines += ["", "Measured by those commands on the networks exported here (their "
                  "weights' digests match each batch's record), in the run the release "
                  "was exported from; FD is in the run's evaluation classifier's "
                  "features, comparable within one machine's folder."]
    else:
        lines.append("Nothing: the run held no evaluated sample batch of these exact weights.")
    lines += ["", "## Use", "", f"In diffusers: {kind_of_release(index)}. The pipeline's code "
              "ships in this folder and `trust_remote_code` runs it (the files below); load a "
              "Hub copy at a pinned `revision` (a commit hash), so that the code you checked "
              "is the code that runs. Before 0.38, diffusers let a Hub repository run its "
              f"code without `trust_remote_code` ({ADVISORIES}; fixed in 0.38.0).", "",
              "```python", "from diffusers import DiffusionPipeline",
              'pipe = DiffusionPipeline.from_pretrained("THIS_FOLDER", trust_remote_code=True)',
              '# from the Hub: from_pretrained("USER/REPO", trust_remote_code=True, '
              'revision="COMMIT_SHA")',
              f"images = pipe({example_request(index)}, num_inference_steps=16, "
              f'routing="{index["routing"]}").images',
              "# any flow scheduler swaps in, e.g. UniPC:",
              "from diffusers import UniPCMultistepScheduler",
              "pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config, "
              'prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)',
              "```", "",
              "With this project (which reads only JSON and safetensors, and runs no code from "
              "the folder):", "", "```bash",
              "python sample.py --run-dir THIS_FOLDER --routing top1 --n 64",
              "python train_expert.py --contribution NAME --data DATA --run-dir "
              "THIS_FOLDER   # join",
              "python train_router.py --from-samples 256 --run-dir THIS_FOLDER",
              "python export.py --run-dir THIS_FOLDER --out GROWN_RELEASE", "```", ""]
    if index.get("code"):
        lines += [f"`trust_remote_code` runs these {len(index['code'])} files of this folder "
                  "(the pipeline's module at the root; diffusers imports each custom "
                  "component's class from a module in that component's own folder); their "
                  "SHA-256, also in model_index.json under `_ddm.code`, let you check them "
                  "(`sha256sum`) before you load:", ""]
        lines += [f"- `{path}` {digest}" for path, digest in index["code"].items()] + [""]
    diffusers = any(e.get("layout") == "diffusers" for e in experts)
    if diffusers and index["condition"]["kind"] == "text":
        lines += ["In diffusers: "
                  "`PixArtTransformer2DModel.from_pretrained(\"THIS_FOLDER/experts/"
                  "NAME\")`; a flow expert's timestep is 1000 t, and "
                  "`null_caption.safetensors` holds the `encoder_hidden_states` that "
                  "stand for no caption.", ""]
    elif diffusers:
        first = experts[0]["name"]
        lines += ["In diffusers (a flow expert's timestep is 1000 t; DiT's time "
                  "frequencies need one attribute, since diffusers' DiT uses "
                  "downscale_freq_shift=1 and these experts were trained with "
                  "0):", "", "```python",
                  "from diffusers import DiTTransformer2DModel",
                  'model = '
                  f'DiTTransformer2DModel.from_pretrained("THIS_FOLDER/experts/{first}")',
                  "for block in model.transformer_blocks:",
                  "    block.norm1.emb.time_proj.downscale_freq_shift = 0", "```", ""]
    return "\n".join(lines)
