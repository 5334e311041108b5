/* test_keys.c — keys that tasks, models and optimizer rules declare for
 * themselves (keys.h): read from their recipe sections with defaults,
 * checked with file:line:key, shown by --keys and the resolved YAML (which
 * reads back the same), set by hand in C, and bad declarations refused
 * when registered. */
#include "kpl_test.h"
#include "recipe_case.h"
#include "run_impl.h"

#include <math.h>
#include <stdlib.h>
#include <unistd.h>

static kpl_recipe R;
static char dir[64];

static void write_file(const char *name, const char *text, char *path, size_t len)
{
    kpl_test_write(dir, name, text, path, len);
}

/* ---- owners registered by this program ---- */

static const kpl_key task_keys[] = {
    {"iou", KPL_KEY_FLOAT, "0.5", 0, 1, NULL, "an IoU threshold"},
    {"levels", KPL_KEY_INT, "5", 1, 8, NULL, "pyramid levels"},
    {"soft", KPL_KEY_BOOL, "false", 0, 0, NULL, "soft NMS"},
    {"loss", KPL_KEY_CHOICE, "giou", 0, 0, "iou|giou|diou", "box loss"},
    {"tag", KPL_KEY_STRING, "\"\"", 0, 0, NULL, "a free text"},
    {"strides", KPL_KEY_INTS, "[8, 16, 32]", 1, 128, NULL, "strides"},
    {"ratios", KPL_KEY_FLOATS, "[0.5, 1, 2]", 0.01, 100, NULL, "anchor ratios"},
    {"classes", KPL_KEY_INT, NULL, 1, 1000, NULL, "object classes"},
    {NULL, 0, NULL, 0, 0, NULL, NULL},
};
/* A task's table must be whole (task.h); these never run here. */
static kpl_status tk_create(kpl_trainer *t, void **state)
{
    (void)t, (void)state;
    return KPL_ERROR(KPL_EINVAL, "tk: not for training");
}
static void tk_destroy(void *state) { (void)state; }
static kpl_status tk_step(kpl_trainer *t, void *state, const kpl_batch *b, kpl_step_result *o)
{
    (void)t, (void)state, (void)b, (void)o;
    return KPL_OK;
}
static kpl_status tk_eval(kpl_trainer *t, void *state) { return (void)t, (void)state, KPL_OK; }
static kpl_status tk_eval_batch(kpl_trainer *t, void *state, const kpl_batch *b)
{
    return (void)t, (void)state, (void)b, KPL_OK;
}
static kpl_status tk_eval_end(kpl_trainer *t, void *state, kpl_eval_result *res)
{
    return (void)t, (void)state, (void)res, KPL_OK;
}
#define TK_FUNCTIONS                                                                      \
    .best_metric = "loss", .create = tk_create, .destroy = tk_destroy, .train_step = tk_step, \
    .eval_begin = tk_eval, .eval_batch = tk_eval_batch, .eval_end = tk_eval_end
static const kpl_task_kind tk = {.name = "tk", .keys = task_keys, TK_FUNCTIONS};

static const kpl_key model_keys[] = {
    {"width", KPL_KEY_INT, "16", 1, 1024, NULL, "channels"},
    {NULL, 0, NULL, 0, 0, NULL, NULL},
};

static kpl_status tkm_create(kpl_module *parent, const char *child, const kpl_model_config *cfg,
                             kpl_device *dev, uint64_t seed, kpl_module **out)
{
    int64_t width = 0;
    KPL_TRY(kpl_key_int(&cfg->keys, "width", &width));
    kpl_module *m = NULL;
    if (parent) KPL_TRY(kpl_nn_sequential(parent, child, &m));
    else KPL_TRY(kpl_nn_sequential_root(dev, seed, &m));
    *out = m;
    return kpl_nn_linear(m, "fc", cfg->in_channels * cfg->in_h * cfg->in_w, width, true, NULL);
}
static const kpl_zoo_model tkm = {.name = "tkm", .doc = "a test model", .create = tkm_create,
                                  .keys = model_keys};

static const kpl_key rule_keys[] = {
    {"scale", KPL_KEY_FLOAT, "1", 0, 10, NULL, "update scale"},
    {NULL, 0, NULL, 0, 0, NULL, NULL},
};
static int no_slots(const kpl_optim_config *c, const char *const **names)
{
    (void)c, (void)names;
    return 0;
}
static int no_scratch(const kpl_optim_config *c)
{
    (void)c;
    return 0;
}
/* p -= lr * scale * g */
static kpl_status scaled_update(const kpl_optim_update *u)
{
    double scale = 0;
    KPL_TRY(kpl_key_float(&u->cfg->keys, "scale", &scale));
    float *p = (float *)kpl_tensor_host_data(u->param);
    const float *gr = kpl_tensor_host_data((kpl_tensor *)u->grad);
    KPL_CHECK(p && gr, KPL_EINVAL, "scaled: no data");
    for (int64_t i = 0; i < kpl_tensor_numel(u->param); i++) p[i] -= (float)(u->lr * scale * gr[i]);
    return KPL_OK;
}
static const kpl_optim_rule scaled = {.name = "scaled", .slots = no_slots, .scratch = no_scratch,
                                      .update = scaled_update, .keys = rule_keys};

#define BASE "epochs: 1\ndata: {train: {path: t, batch_size: 8}}\nmodel: {name: cnn, num_classes: 10}\noptimizer: {lr: 0.1}\n"

/* ---- reading ---- */

static void test_values_and_defaults(void **state)
{
    (void)state;
    char path[128];
    write_file("tk.yaml", BASE "task:\n  name: tk\n  tk:\n    levels: 3\n    loss: diou\n"
                          "    tag: hello world\n    strides: [4, 8]\n    classes: 7\n",
               path, sizeof path);
    OK(kpl_recipe_load(path, 0, NULL, &R));
    assert_string_equal(R.task, "tk");
    const kpl_keyvals *kv = &R.task_keys;
    assert_int_equal(kv->n, 8); /* the five given and the three defaults */
    int64_t levels = 0, classes = 0, strides[4];
    double iou = 0, ratios[4];
    bool soft = true;
    const char *loss = NULL, *tag = NULL;
    int n = 0;
    OK(kpl_key_int(kv, "levels", &levels));
    assert_int_equal(levels, 3);
    OK(kpl_key_int(kv, "classes", &classes));
    assert_int_equal(classes, 7);
    OK(kpl_key_float(kv, "iou", &iou));
    assert_float_equal(iou, 0.5, 0);
    OK(kpl_key_bool(kv, "soft", &soft));
    assert_false(soft);
    OK(kpl_key_string(kv, "loss", &loss));
    assert_string_equal(loss, "diou");
    OK(kpl_key_string(kv, "tag", &tag));
    assert_string_equal(tag, "hello world");
    OK(kpl_key_ints(kv, "strides", strides, 4, &n));
    assert_int_equal(n, 2);
    assert_int_equal(strides[0], 4);
    assert_int_equal(strides[1], 8);
    OK(kpl_key_floats(kv, "ratios", ratios, 4, &n));
    assert_int_equal(n, 3);
    assert_float_equal(ratios[0], 0.5, 0);
    assert_float_equal(ratios[2], 2, 0);
    /* the owner's order, whatever the recipe's */
    for (int i = 0; i < kv->n; i++) assert_string_equal(kv->v[i].name, task_keys[i].name);
    /* typed reads of the wrong type, unknown names, a list that does not fit */
    FAILS(kpl_key_int(kv, "loss", &levels), KPL_EINVAL, "key 'loss' holds 'diou', not an integer");
    FAILS(kpl_key_int(kv, "nope", &levels), KPL_ENOTFOUND, "no key 'nope' (the set has: iou, levels, soft,");
    FAILS(kpl_key_ints(kv, "strides", strides, 1, &n), KPL_ERANGE, "more than 1 values");
    FAILS(kpl_key_bool(kv, "levels", &soft), KPL_EINVAL, "not true or false");

    /* the short form, a base, and overrides of the task's keys */
    write_file("tk2.yaml", "base: tk.yaml\ntask: tk\n", path, sizeof path);
    const char *ov[] = {"task.tk.iou=0.25", "task.tk.soft=yes", "task.tk.ratios=3"};
    OK(kpl_recipe_load(path, 3, ov, &R));
    OK(kpl_key_float(&R.task_keys, "iou", &iou));
    assert_float_equal(iou, 0.25, 0);
    OK(kpl_key_bool(&R.task_keys, "soft", &soft));
    assert_true(soft);
    OK(kpl_key_floats(&R.task_keys, "ratios", ratios, 4, &n));
    assert_int_equal(n, 1);
    assert_float_equal(ratios[0], 3, 0);
    OK(kpl_key_int(&R.task_keys, "levels", &levels)); /* the base's, kept */
    assert_int_equal(levels, 3);

    /* model and optimizer sections */
    const char *ov2[] = {"model.name=tkm", "model.tkm.width=33", "optimizer.name=scaled",
                         "optimizer.scaled.scale=2.5"};
    OK(kpl_recipe_load(path, 4, ov2, &R));
    int64_t width = 0;
    double scale = 0;
    OK(kpl_key_int(&R.model.keys, "width", &width));
    assert_int_equal(width, 33);
    OK(kpl_key_float(&R.optimizer.config.keys, "scale", &scale));
    assert_float_equal(scale, 2.5, 0);
    const char *ov3[] = {"model.name=tkm", "optimizer.name=scaled"};
    OK(kpl_recipe_load(path, 2, ov3, &R)); /* defaults */
    OK(kpl_key_int(&R.model.keys, "width", &width));
    assert_int_equal(width, 16);
    OK(kpl_key_float(&R.optimizer.config.keys, "scale", &scale));
    assert_float_equal(scale, 1, 0);
}

static void test_errors(void **state)
{
    (void)state;
    static const recipe_case cases[] = {
        {"task:\n  name: tk\n  tk:\n    levels: 9\n    classes: 1\n", NULL, KPL_ERANGE,
         "bad.yaml:8:13: task.tk.levels: 9 is out of range [1, 8]"},
        {"task:\n  name: tk\n  tk:\n    levels: two\n    classes: 1\n", NULL, KPL_EINVAL,
         "bad.yaml:8:13: task.tk.levels: expected an integer, got 'two'"},
        {"task:\n  name: tk\n  tk:\n    levles: 2\n    classes: 1\n", NULL, KPL_EINVAL,
         "bad.yaml:8:5: unknown key 'task.tk.levles' (task.tk has: iou, levels, soft, loss, "
         "tag, strides, ratios, classes; did you mean 'levels'?)"},
        {"task:\n  name: tk\n  tk:\n    loss: l1\n    classes: 1\n", NULL, KPL_EINVAL,
         "bad.yaml:8:11: task.tk.loss: expected one of iou|giou|diou; got 'l1'"},
        {"task:\n  name: tk\n  tk:\n    soft: maybe\n    classes: 1\n", NULL, KPL_EINVAL,
         "task.tk.soft: expected true or false, got 'maybe'"},
        {"task:\n  name: tk\n  tk:\n    strides: [8, 256]\n    classes: 1\n", NULL, KPL_ERANGE,
         "bad.yaml:8:18: task.tk.strides: 256 is out of range [1, 128]"},
        {"task:\n  name: tk\n  tk:\n    levels: [1]\n    classes: 1\n", NULL, KPL_EINVAL,
         "task.tk.levels: expected an integer, got a list"},
        {"task:\n  name: tk\n  tk:\n    tag: {a: 1}\n    classes: 1\n", NULL, KPL_EINVAL,
         "task.tk.tag: expected a string, got a section"},
        {"task: tk\n", NULL, KPL_EINVAL,
         "bad.yaml: missing required key 'task.tk.classes' (object classes)"},
        {"task:\n  name: classification\n  tk:\n    classes: 1\n", NULL, KPL_EINVAL,
         "bad.yaml:7:3: task.tk: keys of task 'tk', but task.name is 'classification'"},
        {"task:\n  name: tk\n  tk:\n    classes: 1\n", "task=classification", KPL_EINVAL,
         "task.tk: keys of task 'tk', but task.name is 'classification'"},
        {"task:\n  name: mine\n  mine:\n    x: 1\n", NULL, KPL_EINVAL,
         "bad.yaml:7:3: task.mine: task 'mine' is not registered, so its keys cannot be read"},
        {"task: {name: tk, tk: {classes: 1}}\n", "task.tk.classes=0", KPL_ERANGE,
         "override 'task.tk.classes=0': task.tk.classes: 0 is out of range [1, 1000]"},
        {"task: {name: tk, tk: 3}\n", NULL, KPL_EINVAL, "bad.yaml:5:18: unknown key 'task.tk'"},
        {"model:\n  tkm:\n    width: 0\n", "model.name=tkm", KPL_ERANGE,
         "bad.yaml:7:12: model.tkm.width: 0 is out of range [1, 1024]"},
        {"model:\n  name: cnn\n  cnn:\n    width: 2\n", NULL, KPL_EINVAL,
         "bad.yaml:7:3: model.cnn: model 'cnn' has no keys of its own"},
        {"optimizer:\n  lr: 0.1\n  scaled:\n    scale: -1\n", "optimizer.name=scaled",
         KPL_ERANGE, "bad.yaml:8:12: optimizer.scaled.scale: -1 is out of range [0, 10]"},
        {"optimizer:\n  lr: 0.1\n  sgd:\n    scale: 1\n", NULL, KPL_EINVAL,
         "bad.yaml:7:3: optimizer.sgd: optimizer 'sgd' has no keys of its own"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char text[1024], path[128];
        /* four lines, so that a case starts on line 5; a case with a
         * model or optimizer section of its own replaces that line */
        bool model = !strncmp(cases[i].yaml, "model:", 6);
        bool optim = !strncmp(cases[i].yaml, "optimizer:", 10);
        snprintf(text, sizeof text, "epochs: 1\ndata: {train: {path: t, batch_size: 8}}\n%s%s%s",
                 model ? "seed: 0\n" : "model: {name: cnn, num_classes: 10}\n",
                 optim ? "threads: 0\n" : "optimizer: {lr: 0.1}\n", cases[i].yaml);
        write_file("bad.yaml", text, path, sizeof path);
        check_recipe_case(i, &cases[i], path, &R);
    }
}

/* The resolved YAML carries the owners' values and reads back the same;
 * --keys lists every registered owner's keys. */
static void test_round_trip_and_listing(void **state)
{
    (void)state;
    const char *ov[] = {"task.tk.tag=a \"quoted\" # a comment", "task.tk.classes=4",
                        "model.name=tkm", "model.tkm.width=8", "task.tk.ratios=[0.1, 0.3]"};
    OK(kpl_recipe_load_string(BASE "task: tk\n", "rt", 5, ov, &R));
    char *yaml = NULL;
    OK(kpl_recipe_to_yaml(&R, &yaml));
    assert_non_null(strstr(yaml, "task:\n  name: \"tk\"\n  tk:\n    iou: 0.5\n"));
    assert_non_null(strstr(yaml, "    tag: \"a \\\"quoted\\\"\"\n"));
    assert_non_null(strstr(yaml, "    ratios: [0.1, 0.3]\n"));
    assert_non_null(strstr(yaml, "  tkm:\n    width: 8\n"));
    kpl_recipe *back = malloc(sizeof *back);
    assert_non_null(back);
    OK(kpl_recipe_load_string(yaml, "back", 0, NULL, back));
    assert_int_equal(back->task_keys.n, R.task_keys.n);
    /* the same bytes: the round trip of config.yaml */
    assert_memory_equal(&back->task_keys, &R.task_keys, sizeof R.task_keys);
    assert_memory_equal(&back->model.keys, &R.model.keys, sizeof R.model.keys);
    assert_string_equal(back->model.keys.v[0].value, "8");
    free(back);
    free(yaml);

    char path[128];
    snprintf(path, sizeof path, "%s/keys.txt", dir);
    FILE *f = fopen(path, "w+");
    assert_non_null(f);
    kpl_recipe_print_keys(f);
    rewind(f);
    static char text[1 << 16];
    size_t n = fread(text, 1, sizeof text - 1, f);
    text[n] = 0;
    fclose(f);
    assert_non_null(strstr(text, "  classification:  # task classification's own keys; it needs "
                                 "model.name, model.num_classes\n    top_k: 5  #"));
    assert_non_null(strstr(text, "  tk:  # task tk's own keys\n    iou: 0.5  # an IoU threshold "
                                 "[0, 1]\n"));
    assert_non_null(strstr(text, "    loss: giou  # box loss [iou|giou|diou]\n"));
    assert_non_null(strstr(text, "    classes: REQUIRED  # object classes [1, 1000]\n"));
    assert_non_null(strstr(text, "  tkm:  # model tkm's own keys (a test model)\n    width: 16"));
    assert_non_null(strstr(text, "  scaled:  # optimizer scaled's own keys\n    scale: 1"));
}

/* A configuration made in C: values set by hand, checked, defaults filled
 * by the zoo and the optimizer. */
static void test_by_hand(void **state)
{
    (void)state;
    kpl_keyvals kv = {0};
    OK(kpl_keyvals_set(&kv, "tag", "[not yaml: a string]"));
    OK(kpl_keyvals_set(&kv, "classes", "12"));
    OK(kpl_keyvals_set(&kv, "strides", "[2, 4]"));
    OK(kpl_keyvals_check(task_keys, "task.tk", &kv));
    const char *tag = NULL;
    OK(kpl_key_string(&kv, "tag", &tag));
    assert_string_equal(tag, "[not yaml: a string]");
    int64_t levels = 0;
    OK(kpl_key_int(&kv, "levels", &levels));
    assert_int_equal(levels, 5);
    kpl_keyvals bad = {0};
    OK(kpl_keyvals_set(&bad, "levels", "1.5"));
    FAILS(kpl_keyvals_check(task_keys, "task.tk", &bad), KPL_EINVAL,
          "configuration: task.tk.levels: expected an integer, got '1.5'");
    kpl_keyvals unknown = {0};
    OK(kpl_keyvals_set(&unknown, "level", "1"));
    FAILS(kpl_keyvals_check(task_keys, "task.tk", &unknown), KPL_EINVAL,
          "task.tk.level: unknown key (task.tk has: iou, levels,");
    kpl_keyvals none = {0};
    FAILS(kpl_keyvals_check(task_keys, "task.tk", &none), KPL_EINVAL,
          "missing required key 'task.tk.classes'");
    char longv[400];
    memset(longv, '1', sizeof longv - 1);
    longv[sizeof longv - 1] = 0;
    FAILS(kpl_keyvals_set(&none, "classes", longv), KPL_EINVAL, "value longer than 207 bytes");

    /* the zoo fills a model's key defaults; create reads them */
    kpl_model_config mc = {.name = "tkm", .num_classes = 3, .in_channels = 1, .in_h = 2, .in_w = 2};
    kpl_module *m = NULL;
    OK(kpl_zoo_create(&mc, kpl_device_cpu(), 1, &m));
    assert_int_equal(kpl_tensor_shape(kpl_module_get_param(kpl_module_find(m, "fc"), "weight"))[0], 16);
    kpl_module_destroy(m);
    OK(kpl_keyvals_set(&mc.keys, "width", "5"));
    OK(kpl_zoo_create(&mc, kpl_device_cpu(), 1, &m));
    assert_int_equal(kpl_tensor_shape(kpl_module_get_param(kpl_module_find(m, "fc"), "weight"))[0], 5);
    kpl_module_destroy(m);
    OK(kpl_keyvals_set(&mc.keys, "width", "5000"));
    FAILS(kpl_zoo_create(&mc, kpl_device_cpu(), 1, &m), KPL_ERANGE,
          "model.tkm.width: 5000 is out of range [1, 1024]");
    kpl_module_destroy(m);

    /* the optimizer fills its rule's; the update reads them: p -= lr * scale * g */
    kpl_optim_config oc = KPL_OPTIM_CONFIG_INIT;
    snprintf(oc.name, sizeof oc.name, "scaled");
    oc.lr = 0.5;
    OK(kpl_keyvals_set(&oc.keys, "scale", "2"));
    int64_t shape[1] = {2};
    kpl_tensor *p = NULL, *c = NULL;
    OK(kpl_tensor_zeros(kpl_device_cpu(), KPL_F32, 1, shape, &p));
    OK(kpl_tensor_zeros(kpl_device_cpu(), KPL_F32, 1, shape, &c));
    ((float *)kpl_tensor_host_data(c))[0] = 1, ((float *)kpl_tensor_host_data(c))[1] = -2;
    OK(kpl_set_requires_grad(p, true));
    kpl_pool *pool = kpl_pool_push();
    OK(kpl_backward(kpl_sum(kpl_mul(p, c), NULL, 0, false), NULL, false)); /* p.grad = c */
    kpl_pool_pop(pool);
    kpl_optim *o = NULL;
    OK(kpl_optim_create(&oc, 1, &p, NULL, &o));
    OK(kpl_optim_step(o));
    assert_float_equal(((float *)kpl_tensor_host_data(p))[0], -1, 0);
    assert_float_equal(((float *)kpl_tensor_host_data(p))[1], 2, 0);
    kpl_optim_destroy(o);
    OK(kpl_keyvals_set(&oc.keys, "scales", "2"));
    FAILS(kpl_optim_create(&oc, 1, &p, NULL, &o), KPL_EINVAL,
          "optimizer.scaled.scales: unknown key (optimizer.scaled has: scale)");
    kpl_tensor_release(p);
    kpl_tensor_release(c);
}

/* Declarations are checked when registered: a bad one names the owner. */
static void test_bad_declarations(void **state)
{
    (void)state;
    static const kpl_key bad_name[] = {{"Levels", KPL_KEY_INT, "1", 0, 0, NULL, "x"}, {NULL}};
    static const kpl_key bad_default[] = {{"n", KPL_KEY_INT, "99", 1, 8, NULL, "x"}, {NULL}};
    static const kpl_key no_choices[] = {{"c", KPL_KEY_CHOICE, "a", 0, 0, NULL, "x"}, {NULL}};
    static const kpl_key not_a_choice[] = {{"c", KPL_KEY_CHOICE, "z", 0, 0, "a|b", "x"}, {NULL}};
    static const kpl_key twice[] = {{"a", KPL_KEY_INT, "1", 0, 0, NULL, "x"},
                                    {"a", KPL_KEY_INT, "1", 0, 0, NULL, "x"}, {NULL}};
    static const kpl_key no_doc[] = {{"a", KPL_KEY_INT, "1", 0, 0, NULL, NULL}, {NULL}};
    static const struct {
        const kpl_key *keys;
        const char *needle;
    } cases[] = {
        {bad_name, "task.bad: key name 'Levels' must be 1 to 47 of [a-z0-9_]"},
        {bad_default, "task 'bad' (registered by the program): declared default: task.bad.n: 99 is out of range [1, 8]"},
        {no_choices, "task.bad.c: a choice key needs its choices"},
        {not_a_choice, "task.bad.c: expected one of a|b; got 'z'"},
        {twice, "task.bad: key 'a' declared twice"},
        {no_doc, "task.bad.a: no doc line"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kpl_task_kind *k = calloc(1, sizeof *k);
        *k = (kpl_task_kind){TK_FUNCTIONS};
        k->name = "bad";
        k->keys = cases[i].keys;
        kpl_clear_error();
        kpl_status st = kpl_task_register(k);
        if (st >= 0 || !strstr(kpl_last_error(), cases[i].needle))
            fail_msg("case %zu: got %s '%s', expected '%s'", i, kpl_status_str(st),
                     kpl_last_error(), cases[i].needle);
        assert_null(kpl_task_find("bad")); /* nothing kept */
        free(k);
    }
    /* the table itself: a missing function, a need that is no key */
    static const char *const unknown_need[] = {"model.num_classes", "model.nosuch", NULL};
    for (int i = 0; i < 3; i++) {
        kpl_task_kind k = {TK_FUNCTIONS};
        k.name = "bad";
        const char *needle = NULL;
        if (i == 0) k.create = NULL, needle = "task 'bad' (registered by the program): no create function";
        if (i == 1) k.train_step = NULL, needle = "neither train_step nor train_batch";
        if (i == 2) k.needs = unknown_need, needle = "needs 'model.nosuch', which is not one of kpl's recipe keys";
        kpl_clear_error();
        kpl_status st = kpl_task_register(&k);
        if (st >= 0 || !strstr(kpl_last_error(), needle))
            fail_msg("table case %d: got %s '%s', expected '%s'", i, kpl_status_str(st),
                     kpl_last_error(), needle);
        assert_null(kpl_task_find("bad"));
    }
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/kpl-keys-XXXXXX");
    if (!mkdtemp(dir)) return 1;
    if (kpl_task_register(&tk) < 0 || kpl_zoo_register(&tkm) < 0 ||
        kpl_optim_register(&scaled) < 0) {
        fprintf(stderr, "register: %s\n", kpl_last_error());
        return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_values_and_defaults), cmocka_unit_test(test_errors),
        cmocka_unit_test(test_round_trip_and_listing), cmocka_unit_test(test_by_hand),
        cmocka_unit_test(test_bad_declarations),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) rc = rc ? rc : 1;
    return rc;
}
