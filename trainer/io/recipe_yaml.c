/*
 * recipe_yaml.c — YAML recipes as trees: libyaml's events become nodes that
 * remember where every value came from (file, line, column, or the command
 * line); `base:` files and KEY=VALUE overrides are laid over them.
 */
#include "recipe_impl.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml.h>

/* ---- the tree ------------------------------------------------------------------------- */


const char *kpl__rc_keep_origin(ctx *c, const char *s)
{
    if (c->norigins == (int)(sizeof c->origins / sizeof c->origins[0])) return "?";
    char *d = strdup(s);
    if (!d) return "?";
    c->origins[c->norigins++] = d;
    return d;
}

void kpl__rc_node_free(node *n)
{
    while (n) {
        node *next = n->next;
        kpl__rc_node_free(n->first);
        free(n->key);
        free(n->text);
        free(n);
        n = next;
    }
}

static void append(node *parent, node *child)
{
    child->next = NULL;
    if (parent->last) parent->last->next = child;
    else parent->first = child;
    parent->last = child;
}

node *kpl__rc_child(const node *map, const char *key)
{
    for (node *c = map->first; c; c = c->next)
        if (!strcmp(c->key, key)) return c;
    return NULL;
}


const char *kpl__rc_clip(const char *s, bool path, char *buf)
{
    size_t n = strlen(s), max = path ? PATH_ECHO_MAX : ECHO_MAX;
    if (n <= max) return s;
    if (path) {
        const char *t = s + n - max;
        while ((*t & 0xC0) == 0x80) t++;
        snprintf(buf, PATH_ECHO_MAX + 4, "...%s", t);
    } else {
        while (max > 0 && (s[max] & 0xC0) == 0x80) max--;
        snprintf(buf, PATH_ECHO_MAX + 4, "%.*s...", (int)max, s);
    }
    return buf;
}

/* "file:12:3" or "override 'a.b=c'" */
const char *kpl__rc_where(const node *n, char *buf, size_t len)
{
    if (!n) snprintf(buf, len, "(default)");
    else if (n->line > 0) snprintf(buf, len, "%s:%d:%d", CLIP_PATH(n->origin), n->line, n->col);
    else snprintf(buf, len, "override '%s'", CLIP(n->origin));
    return buf;
}

/* The place of a map entry's key (the value's for overrides). */
const char *kpl__rc_where_key(const node *n, char *buf, size_t len)
{
    if (n && n->line > 0 && n->kline > 0) {
        snprintf(buf, len, "%s:%d:%d", CLIP_PATH(n->origin), n->kline, n->kcol);
        return buf;
    }
    return kpl__rc_where(n, buf, len);
}

/* The dotted key of the node being parsed, for messages: `prefix` (an
 * override's key), the keys of the open maps ("[]" for a list's
 * elements), then `last` (the key the node is the value of, or is). */
static void key_path(const char *prefix, node *const *stack, int depth, const char *last,
                     char *buf, size_t len)
{
    size_t at = (size_t)snprintf(buf, len, "%s", prefix);
    for (int i = 1; i <= depth && at < len; i++) {
        const char *k = i < depth ? stack[i]->key : last;
        if (i < depth && !k) at += (size_t)snprintf(buf + at, len - at, "[]");
        else if (k) at += (size_t)snprintf(buf + at, len - at, "%s%s", at ? "." : "", k);
    }
}

/* The error of a tagged value at `here`, the value of `key`. */
static kpl_status tag_refused(const node *here, const char *key, const char *tag)
{
    char at[400], shown[80];
    const char *std = "tag:yaml.org,2002:"; /* !!str is short for it */
    if (!strncmp(tag, std, strlen(std)))
        snprintf(shown, sizeof shown, "!!%s", CLIP(tag + strlen(std)));
    else snprintf(shown, sizeof shown, "%s", CLIP(tag));
    return KPL_ERROR(KPL_EFORMAT, "%s: %s%sYAML tags (%s) are not supported in recipes; write "
                     "the value without one", kpl__rc_where(here, at, sizeof at), CLIP(key),
                     key[0] ? ": " : "", shown);
}

/* The node of a scalar or of a collection's start, placed as `here`; on
 * KPL_ENOMEM *out may hold a node for the caller to free. */
static kpl_status new_node(const yaml_event_t *ev, const node *here, node **out)
{
    node *n = *out = calloc(1, sizeof *n);
    KPL_CHECK(n, KPL_ENOMEM, "out of memory");
    n->origin = here->origin;
    n->line = here->line;
    n->col = here->col;
    if (ev->type != YAML_SCALAR_EVENT) {
        n->kind = ev->type == YAML_MAPPING_START_EVENT ? N_MAP : N_SEQ;
        return KPL_OK;
    }
    n->kind = N_SCALAR;
    n->text = strndup((const char *)ev->data.scalar.value, ev->data.scalar.length);
    const char *v = n->text ? n->text : "";
    n->null = ev->data.scalar.style == YAML_PLAIN_SCALAR_STYLE &&
              (!*v || !strcmp(v, "~") || !strcmp(v, "null") || !strcmp(v, "Null") ||
               !strcmp(v, "NULL"));
    KPL_CHECK(n->text, KPL_ENOMEM, "out of memory");
    return KPL_OK;
}

/* libyaml's events into a tree.  Aliases are refused: recipes are read
 * by people, and a key whose value lives elsewhere helps nobody.  So are
 * tags (!!str 5): a recipe's key fixes the type of its value, and a tag
 * that kpl ignored would say one thing and do another.  `at_key` is the
 * key the text is the value of ("" for a file). */
kpl_status kpl__rc_parse_yaml(const char *text, size_t len, const char *origin, bool is_file,
                              const char *at_key, node **out)
{
    *out = NULL;
    yaml_parser_t p;
    if (!yaml_parser_initialize(&p)) return KPL_ERROR(KPL_ENOMEM, "%s: out of memory", origin);
    yaml_parser_set_input_string(&p, (const unsigned char *)text, len);
    kpl_status st = KPL_OK;
    enum { DEPTH = 64 };
    node *stack[DEPTH];
    char *pending[DEPTH]; /* a map's key waiting for its value */
    int pline[DEPTH], pcol[DEPTH];
    int depth = 0, docs = 0;
    node *root = NULL;
    memset(pending, 0, sizeof pending);
    for (bool done = false; !done;) {
        yaml_event_t ev;
        char at[400]; /* the place of the event, or of the error */
        if (!yaml_parser_parse(&p, &ev)) {
            node mark = {.origin = origin, .line = is_file ? (int)p.problem_mark.line + 1 : 0,
                         .col = (int)p.problem_mark.column + 1};
            st = KPL_ERROR(KPL_EFORMAT, "%s: YAML syntax error: %s%s%s",
                           kpl__rc_where(&mark, at, sizeof at), p.problem ? p.problem : "unknown",
                           p.context ? " " : "", p.context ? p.context : "");
            goto fail;
        }
        int line = is_file ? (int)ev.start_mark.line + 1 : 0;
        int col = (int)ev.start_mark.column + 1;
        node here = {.origin = origin, .line = line, .col = col};
        node *n = NULL;
        switch (ev.type) {
        case YAML_STREAM_END_EVENT: done = true; break;
        case YAML_DOCUMENT_START_EVENT:
            if (++docs > 1)
                st = KPL_ERROR(KPL_EFORMAT, "%s: a recipe is one YAML document, found a second "
                               "one", kpl__rc_where(&here, at, sizeof at));
            break;
        case YAML_ALIAS_EVENT:
            st = KPL_ERROR(KPL_EFORMAT, "%s: YAML aliases (*%s) are not supported in recipes; "
                           "use 'base:' to share settings", kpl__rc_where(&here, at, sizeof at),
                           CLIP((const char *)ev.data.alias.anchor));
            break;
        case YAML_SCALAR_EVENT:
        case YAML_SEQUENCE_START_EVENT:
        case YAML_MAPPING_START_EVENT: {
            node *parent = depth ? stack[depth - 1] : NULL;
            const char *tag = (const char *)(ev.type == YAML_SCALAR_EVENT ? ev.data.scalar.tag
                                             : ev.type == YAML_SEQUENCE_START_EVENT
                                                 ? ev.data.sequence_start.tag
                                                 : ev.data.mapping_start.tag);
            if (tag) {
                /* the key this is the value of, or the key it is */
                const char *last = NULL;
                if (parent && parent->kind == N_MAP)
                    last = pending[depth - 1] ? pending[depth - 1]
                           : ev.type == YAML_SCALAR_EVENT ? (const char *)ev.data.scalar.value
                                                           : NULL;
                char key[300];
                key_path(at_key, stack, depth, last, key, sizeof key);
                st = tag_refused(&here, key, tag);
                break;
            }
            if (ev.type == YAML_SCALAR_EVENT &&
                strlen((const char *)ev.data.scalar.value) != ev.data.scalar.length) {
                /* "\0" in a quoted scalar: C strings would cut it short */
                st = KPL_ERROR(KPL_EFORMAT, "%s: a NUL character in a value or key",
                               kpl__rc_where(&here, at, sizeof at));
                break;
            }
            if (parent && parent->kind == N_MAP && !pending[depth - 1]) {
                /* a key */
                if (ev.type != YAML_SCALAR_EVENT) {
                    st = KPL_ERROR(KPL_EFORMAT, "%s: keys must be plain names",
                                   kpl__rc_where(&here, at, sizeof at));
                    break;
                }
                const char *k = (const char *)ev.data.scalar.value;
                if (kpl__rc_child(parent, k)) {
                    node *prev = kpl__rc_child(parent, k);
                    char w[1200];
                    st = KPL_ERROR(KPL_EFORMAT, "%s: key '%s' appears twice (first at %s)",
                                   kpl__rc_where(&here, at, sizeof at), CLIP(k),
                                   kpl__rc_where_key(prev, w, sizeof w));
                    break;
                }
                if (!(pending[depth - 1] = strdup(k))) st = KPL_ERROR(KPL_ENOMEM, "out of memory");
                pline[depth - 1] = line, pcol[depth - 1] = col;
                break;
            }
            if ((st = new_node(&ev, &here, &n)) < 0) {
                kpl__rc_node_free(n);
                break;
            }
            if (parent) {
                if (parent->kind == N_MAP) {
                    n->key = pending[depth - 1];
                    n->kline = pline[depth - 1], n->kcol = pcol[depth - 1];
                    pending[depth - 1] = NULL;
                }
                append(parent, n);
            } else {
                root = n;
            }
            if (n->kind != N_SCALAR) {
                if (depth == DEPTH) {
                    st = KPL_ERROR(KPL_EFORMAT, "%s: nested too deeply",
                                   kpl__rc_where(&here, at, sizeof at));
                    break;
                }
                pending[depth] = NULL;
                stack[depth++] = n;
            }
            break;
        }
        case YAML_SEQUENCE_END_EVENT:
        case YAML_MAPPING_END_EVENT: depth--; break;
        default: break;
        }
        yaml_event_delete(&ev);
        if (st < 0) goto fail;
    }
    *out = root;
    yaml_parser_delete(&p);
    return KPL_OK;
fail:
    for (int i = 0; i < DEPTH; i++) free(pending[i]);
    kpl__rc_node_free(root);
    yaml_parser_delete(&p);
    return st;
}

/* Recipes are small text files; anything else (a FIFO, a device, a
 * directory, a huge file) is refused. */
#define RECIPE_MAX_BYTES (1 << 20)

/* What a path that is not a regular file is, for the message. */
static const char *file_kind(mode_t m)
{
    if (S_ISDIR(m)) return "a directory";
    if (S_ISFIFO(m)) return "a FIFO";
    if (S_ISCHR(m)) return "a character device";
    if (S_ISBLK(m)) return "a block device";
    if (S_ISSOCK(m)) return "a socket";
    return "of an unknown kind";
}

static kpl_status read_file(const char *path, char **text, size_t *len)
{
    /* Judged by stat before any open: opening a FIFO waits for a writer
     * that may never come, and opening a device can act on it. */
    struct stat sb;
    KPL_CHECK(stat(path, &sb) == 0, KPL_EIO, "recipe %s: %s", CLIP_PATH(path), strerror(errno));
    KPL_CHECK(S_ISREG(sb.st_mode), KPL_EINVAL, "recipe %s: not a regular file (%s)",
              CLIP_PATH(path), file_kind(sb.st_mode));
    KPL_CHECK(sb.st_size <= RECIPE_MAX_BYTES, KPL_EINVAL,
              "recipe %s: larger than 1 MiB: not a recipe", CLIP_PATH(path));
    /* Non-blocking and checked again: a path swapped for a FIFO after the
     * stat is refused, not waited on. */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    KPL_CHECK(fd >= 0, KPL_EIO, "recipe %s: %s", CLIP_PATH(path), strerror(errno));
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return KPL_ERROR(KPL_EINVAL, "recipe %s: not a regular file", CLIP_PATH(path));
    }
    char *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n + 4096 > cap) {
            cap = cap ? 2 * cap : 16384;
            char *b = realloc(buf, cap);
            if (!b) {
                free(buf);
                close(fd);
                return KPL_ERROR(KPL_ENOMEM, "recipe %s: out of memory", CLIP_PATH(path));
            }
            buf = b;
        }
        ssize_t r = read(fd, buf + n, cap - n - 1);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            int e = errno;
            free(buf);
            close(fd);
            return KPL_ERROR(KPL_EIO, "recipe %s: %s", CLIP_PATH(path), strerror(e));
        }
        if (r == 0) break;
        n += (size_t)r;
        if (n > RECIPE_MAX_BYTES) { /* it grew while being read */
            free(buf);
            close(fd);
            return KPL_ERROR(KPL_EINVAL, "recipe %s: larger than 1 MiB: not a recipe",
                             CLIP_PATH(path));
        }
    }
    close(fd);
    buf[n] = 0;
    *text = buf;
    *len = n;
    return KPL_OK;
}

/* src's entries laid over dst (maps merge key by key; everything else is
 * replaced); src is consumed. */
static void merge(node *dst, node *src)
{
    node *c = src->first;
    src->first = src->last = NULL;
    kpl__rc_node_free(src);
    while (c) {
        node *next = c->next;
        c->next = NULL;
        node **link = &dst->first;
        while (*link && strcmp((*link)->key, c->key)) link = &(*link)->next;
        node *old = *link;
        if (old && old->kind == N_MAP && c->kind == N_MAP) {
            merge(old, c);
        } else if (old) {
            c->next = old->next;
            *link = c;
            if (dst->last == old) dst->last = c;
            old->next = NULL;
            kpl__rc_node_free(old);
        } else {
            append(dst, c);
        }
        c = next;
    }
}


kpl_status kpl__rc_load_file(ctx *cx, const char *path, int depth, node **out)
{
    KPL_CHECK(depth < 8, KPL_EINVAL, "recipe %s: 'base' chain deeper than 8 (a loop?)",
              CLIP_PATH(path));
    char *text = NULL;
    size_t len = 0;
    KPL_TRY(read_file(path, &text, &len));
    char dir[KPL_RECIPE_PATH];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash) slash[1] = 0;
    else dir[0] = 0;
    kpl_status st = kpl__rc_load_tree(cx, text, len, kpl__rc_keep_origin(cx, path), true, dir, depth, out);
    free(text);
    return st;
}

/* Parses one file's text, loads its base (relative to `dir`) and lays the
 * file over it. */
/* `task: NAME` is short for `task: {name: NAME}`, so that a file giving
 * one form lays over a base giving the other. */
static kpl_status task_shorthand(node *root)
{
    node *t = kpl__rc_child(root, "task");
    if (!t || t->kind != N_SCALAR) return KPL_OK;
    node *n = calloc(1, sizeof *n);
    if (!n || !(n->key = strdup("name"))) {
        free(n);
        return KPL_ERROR(KPL_ENOMEM, "out of memory");
    }
    n->kind = N_SCALAR, n->text = t->text, n->null = t->null, n->origin = t->origin;
    n->line = t->line, n->col = t->col, n->kline = t->kline, n->kcol = t->kcol;
    t->text = NULL, t->null = false, t->kind = N_MAP, t->first = t->last = n;
    return KPL_OK;
}

kpl_status kpl__rc_load_tree(ctx *cx, const char *text, size_t len, const char *origin,
                             bool is_file, const char *dir, int depth, node **out)
{
    node *root = NULL;
    KPL_TRY(kpl__rc_parse_yaml(text, len, origin, is_file, "", &root));
    if (!root) { /* an empty file */
        root = calloc(1, sizeof *root);
        KPL_CHECK(root, KPL_ENOMEM, "out of memory");
        root->kind = N_MAP;
        root->origin = origin;
    }
    kpl_status shorthand = root->kind == N_MAP ? task_shorthand(root) : KPL_OK;
    if (root->kind != N_MAP || shorthand < 0) {
        char w[1200];
        kpl_status st = shorthand < 0 ? shorthand
                                      : KPL_ERROR(KPL_EFORMAT, "%s: a recipe is a mapping of keys "
                                                  "to values", kpl__rc_where(root, w, sizeof w));
        kpl__rc_node_free(root);
        return st;
    }
    node **link = &root->first, *prev = NULL;
    while (*link && strcmp((*link)->key, "base")) {
        prev = *link;
        link = &(*link)->next;
    }
    node *b = *link;
    if (b) {
        char w[1200];
        *link = b->next;
        if (root->last == b) root->last = prev;
        b->next = NULL;
        if (b->kind != N_SCALAR || b->null) {
            kpl_status st = KPL_ERROR(KPL_EINVAL, "%s: base: expected the path of a recipe",
                                      kpl__rc_where(b, w, sizeof w));
            kpl__rc_node_free(b);
            kpl__rc_node_free(root);
            return st;
        }
        char path[2 * KPL_RECIPE_PATH];
        if (b->text[0] == '/') snprintf(path, sizeof path, "%s", b->text);
        else snprintf(path, sizeof path, "%s%s", dir, b->text);
        node *base = NULL;
        kpl_status st = kpl__rc_load_file(cx, path, depth + 1, &base);
        if (st < 0) {
            char msg[1600];
            snprintf(msg, sizeof msg, "%s", kpl_last_error());
            st = KPL_ERROR(st, "%s: in base: %s", kpl__rc_where(b, w, sizeof w), msg);
            kpl__rc_node_free(b);
            kpl__rc_node_free(root);
            return st;
        }
        kpl__rc_node_free(b);
        merge(base, root);
        root = base;
    }
    *out = root;
    return KPL_OK;
}

/* "a.b.c=value": value parsed as a YAML flow node and placed at a.b.c. */
kpl_status kpl__rc_apply_override(ctx *cx, node *root, const char *ov)
{
    const char *eq = strchr(ov, '=');
    KPL_CHECK(eq && eq > ov, KPL_EINVAL,
              "override '%s': expected KEY=VALUE with a dotted key, e.g. optimizer.lr=0.1",
              CLIP(ov));
    char key[256];
    size_t klen = (size_t)(eq - ov);
    KPL_CHECK(klen < sizeof key, KPL_EINVAL, "override '%s': key too long", CLIP(ov));
    memcpy(key, ov, klen);
    key[klen] = 0;
    const char *origin = kpl__rc_keep_origin(cx, ov);
    node *value = NULL;
    const char *vtext = eq + 1;
    KPL_TRY(kpl__rc_parse_yaml(vtext, strlen(vtext), origin, false, key, &value));
    if (!value) { /* "key=" */
        value = calloc(1, sizeof *value);
        KPL_CHECK(value, KPL_ENOMEM, "out of memory");
        value->kind = N_SCALAR;
        value->null = true;
        value->text = strdup("");
    }
    value->origin = origin;
    if (!strcmp(key, "task") && value->kind != N_MAP) /* task=NAME: task.name */
        snprintf(key, sizeof key, "task.name");
    /* every node of the value names the override */
    node *m = root;
    kpl_status st = KPL_OK;
    for (char *seg = key;;) {
        char *dot = strchr(seg, '.');
        if (dot) *dot = 0;
        if (!*seg) {
            st = KPL_ERROR(KPL_EINVAL, "override '%s': empty part in the key", CLIP(ov));
            goto fail;
        }
        node *c = kpl__rc_child(m, seg);
        if (!dot) {
            value->key = strdup(seg);
            if (!value->key) {
                st = KPL_ERROR(KPL_ENOMEM, "out of memory");
                goto fail;
            }
            if (c && c->kind == N_MAP && value->kind == N_MAP) {
                /* a section given as a map: laid over the recipe's key by
                 * key, as a base is (data={train: {path: x}} keeps the
                 * rest of data) */
                merge(c, value);
            } else if (c) { /* replace in place */
                node **link = &m->first;
                while (*link != c) link = &(*link)->next;
                value->next = c->next;
                *link = value;
                if (m->last == c) m->last = value;
                c->next = NULL;
                kpl__rc_node_free(c);
            } else {
                append(m, value);
            }
            return KPL_OK;
        }
        if (c && c->kind != N_MAP) {
            char w[1200];
            st = KPL_ERROR(KPL_EINVAL, "override '%s': '%s' is a value (%s), not a section",
                           CLIP(ov), CLIP(seg), kpl__rc_where(c, w, sizeof w));
            goto fail;
        }
        if (!c) {
            c = calloc(1, sizeof *c);
            if (!c || !(c->key = strdup(seg))) {
                free(c);
                st = KPL_ERROR(KPL_ENOMEM, "out of memory");
                goto fail;
            }
            c->kind = N_MAP;
            c->origin = origin;
            append(m, c);
        }
        m = c;
        seg = dot + 1;
    }
fail:
    kpl__rc_node_free(value);
    return st;
}
