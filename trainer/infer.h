/*
 * infer.h — a trained model as a program: the model file (.kplm) that
 * `kpl export` writes, and the small C API that loads and runs it.
 *
 *   kpl_model *m = NULL;
 *   if (kpl_model_load("model.kplm", -1, &m) < 0) { puts(kpl_last_error()); ... }
 *   int64_t shape[KPL_MAX_DIMS];
 *   int nd = kpl_model_input_shape(m, 0, shape);        // (B, C, H, W)
 *   ... fill a tensor x of that shape (kpl_transform_image does an image)
 *   kpl_model_set_input(m, 0, x);
 *   kpl_model_run(m);
 *   kpl_tensor *logits = kpl_model_output(m, 0);         // borrowed
 *   kpl_model_destroy(m);
 *
 * The file (docs/model-format.md) is a kpl checkpoint container (zstd,
 * CRC32C, written atomically) whose JSON holds the GraphIR and what
 * inference needs to know (task, input transform, class count) and
 * whose tensors are the graph's parameters and constants.
 */
#ifndef KPL_INFER_H
#define KPL_INFER_H

#include "dataio.h"
#include "checkpoint.h"
#include "ir.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The model format's version this kpl writes; it reads every version up
 * to it. */
#define KPL_MODEL_VERSION 1

typedef struct kpl_model kpl_model;

/* Writes ir (its parameters by name, constants as "const.<value>") and
 * `info`, a JSON object's text (may be NULL: {}), to path: PATH.tmp
 * first, renamed when complete, so a crash never leaves a half file under
 * the name. */
kpl_status kpl_model_save(const kpl_ir *ir, const char *info, const char *path);
/* Loads a model file whose execution will be planned at `level` (0..3;
 * -1: the level it was saved with) on the CPU, at the first set_input or
 * run (that is when its memory is taken).  Every inconsistency is
 * KPL_EFORMAT naming the file and what is wrong (a truncated or damaged
 * file, an op this kpl does not know, a tensor missing or of the wrong
 * shape, shapes that do not follow). */
kpl_status kpl_model_load(const char *path, int level, kpl_model **out);
void kpl_model_destroy(kpl_model *m);

/* The graph (borrowed) and the info object's text (borrowed). */
const kpl_ir *kpl_model_graph(const kpl_model *m);
const char *kpl_model_info(const kpl_model *m);
/* The format version the file was written with. */
int kpl_model_version(const kpl_model *m);

int kpl_model_num_inputs(const kpl_model *m);
const char *kpl_model_input_name(const kpl_model *m, int i);
kpl_dtype kpl_model_input_dtype(const kpl_model *m, int i);
int kpl_model_input_shape(const kpl_model *m, int i, int64_t *shape); /* returns ndim */
int kpl_model_num_outputs(const kpl_model *m);
const char *kpl_model_output_name(const kpl_model *m, int i);

/* Copies x into input i (its shape and dtype: KPL_ESHAPE naming both). */
kpl_status kpl_model_set_input(kpl_model *m, int i, kpl_tensor *x);
kpl_status kpl_model_run(kpl_model *m);
/* Output i of the last run (borrowed, overwritten by the next run); NULL
 * (KPL_ESTATE) before the first run. */
kpl_tensor *kpl_model_output(kpl_model *m, int i);
/* The input transform the info object names ("transform"), for
 * kpl_transform_image: KPL_ENOTFOUND when the file has none. */
kpl_status kpl_model_transform(const kpl_model *m, kpl_transform_config *cfg);

/* ir as an ONNX model (IR version 7, opset 13) at path, parameters and
 * constants as initializers under their names (PATH.tmp first, renamed
 * when complete).  An op with no ONNX form here (the pooling and
 * convolution adjoints, roi_align, gelu_tanh) is KPL_EINVAL naming it. */
kpl_status kpl_onnx_export(const kpl_ir *ir, const char *path);

/* The initializers of the ONNX model at path as a checkpoint (in memory):
 * each as prefix + its name (prefix may be NULL), in its own dtype, except
 * those whose names match one of the nexclude globs (fnmatch).  A
 * torchvision model exported with its parameter names
 * (do_constant_folding=False) carries the state-dict names of kpl's zoo,
 * so kpl_module_state_load takes its weights (docs/static-graph.md).
 * Data may be raw, typed, or external (a file in the model's directory).
 * KPL_EFORMAT naming the file and the initializer; *out owned by the
 * caller (kpl_checkpoint_save writes it). */
kpl_status kpl_onnx_import(const char *path, const char *prefix, int nexclude,
                           const char *const *exclude, kpl_checkpoint **out);

/* The tensors of a PyTorch checkpoint at path (torch.save's zip format,
 * PyTorch 1.6 and later) as a checkpoint (in memory): the state dict at
 * the top of the saved object, or under `key` (NULL: the first of
 * state_dict, model, model_state_dict, module, state_dict_ema, model_ema
 * that holds tensors), each tensor as prefix + its name ("module." before
 * every name dropped; batch norm's num_batches_tracked, a counter kpl does
 * not keep, left out), in its own dtype (f32, f16, bf16, f64, i64, i32,
 * u8, bool), views of shared storages copied out with their offsets and
 * strides; names matching one of the nexclude globs are left out.
 * data.pkl is read by kpl's strict pickle reader: nothing in the file is
 * executed.  torchvision's and timm's state dicts carry the names of
 * kpl's zoo.  KPL_EFORMAT naming the file and what is wrong (a legacy
 * file, a damaged zip, a view past its storage, NaN or inf); *out owned
 * by the caller. */
kpl_status kpl_torch_import(const char *path, const char *prefix, const char *key, int nexclude,
                            const char *const *exclude, kpl_checkpoint **out);

#ifdef __cplusplus
}
#endif
#endif /* KPL_INFER_H */
