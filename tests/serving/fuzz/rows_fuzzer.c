/* libFuzzer harness for serving/native/rows.c, the native reader of row-form predict bodies (network input).
 *
 * Each input is a request body, read the way serving/native_rows.py reads it (NativeRows.read): room for
 * length / 64 + 16 rows first and, on CTR_ROWS_TOO_MANY, once more with room for as many rows as the body has
 * '{' less one; the body in a buffer of exactly its length (a read one byte past it is an AddressSanitizer
 * report, where Python's bytes would hide it behind their trailing zero), the other buffers sized as numpy
 * sizes them and left uninitialised as np.empty leaves them. The layouts are compiled in:
 * - the criteo spec's packed layout (trainer.export.packed_layout): I1..I13 stacked floats, then C1..C26
 *   stacked strings;
 * - tests/serving/test_native_rows.py's layout with its two arguments swapped: C1..C7 strings, then I1..I5
 *   floats (the columns of a kind no longer follow the inputs' order, and I6..I13, C8..C26 are unknown keys);
 * each with a row limit of 1000 and of 3.
 *
 * Besides the sanitizers' reports, a broken property that the Python side relies on is a finding (a line on
 * stderr starting "rows_fuzzer: invariant broken", then __builtin_trap):
 * - the answer is a row count within the room given, CTR_ROWS_NOT_HANDLED, or CTR_ROWS_TOO_MANY; room for
 *   the body's '{' count is never too little, and a body answered TOO_MANY is with more room either not read
 *   or read into more rows than the first room held;
 * - every float read is NaN (a missing key or null) or finite within float32;
 * - every string span lies within the body (between two quotes, with no escape in it) or within the escape
 *   buffer, is at most `longest` bytes (the cells' width, exactly the longest span) and holds well-formed
 *   UTF-8 with no zero byte (a cell drops its trailing zeros);
 * - ctr_fill_cells writes each span into its cell and the rest of the cell stays zero;
 * - a body read gives the very same rows with room for exactly its rows, and with a row limit of 3 the same
 *   rows or TOO_MANY when it has more;
 * - a body read is well-formed JSON (RFC 8259) of the shape rows.c documents (known keys once each, a number
 *   or null for a float, a string or null for a string, the signature's name), and the strict reader here
 *   (strtod on every number, its own UTF-8 and escape decoding) reads the same values bit for bit.
 *
 * Built and run by tools/fuzz_native_rows.sh (`make fuzz-native`; tests/serving/test_native_rows_fuzz.py runs
 * it for a short while in `make test`), with the seeds in corpus/ and the JSON tokens in json.dict.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* rows.c's entry points, as serving/native_rows.py declares them through ctypes. */
int64_t ctr_read_instances(const uint8_t *body, int64_t length, const uint8_t *names, const int32_t *offsets,
                           int32_t count, const int32_t *kinds, const int32_t *columns, int32_t num_floats,
                           int32_t num_strings, const uint8_t *signature, int32_t signature_length,
                           int64_t max_rows, float *floats, int64_t *spans, int64_t *stamps, int64_t *longest,
                           uint8_t *text_data);
void ctr_fill_cells(const uint8_t *body, int64_t length, const uint8_t *text, const int64_t *spans, int64_t count,
                    int64_t width, uint8_t *cells);

#define NOT_HANDLED (-1) /* rows.c's CTR_ROWS_NOT_HANDLED */
#define TOO_MANY (-2)    /* rows.c's CTR_ROWS_TOO_MANY */
#define BYTES_PER_ROW_GUESS 64 /* serving/native_rows.py */
#define FLOAT 0
#define STRING 1
#define MAX_INPUTS 64
#define MISSING_FLOAT_BITS UINT32_C(0x7FC00000) /* numpy's NaN as float32: what None becomes on the general path */

static const char SIGNATURE[] = "serving_default"; /* serving.model.SIGNATURE_NAME */

#define CHECK(condition, ...)                                                                       \
    do {                                                                                            \
        if (!(condition)) {                                                                         \
            fprintf(stderr, "rows_fuzzer: invariant broken (%s:%d, layout %s): ", __FILE__, __LINE__, \
                    current_layout);                                                                \
            fprintf(stderr, __VA_ARGS__);                                                           \
            fputc('\n', stderr);                                                                    \
            __builtin_trap();                                                                       \
        }                                                                                           \
    } while (0)

static const char *current_layout = "-";

/* NativeRows' arrays for one layout, each in a buffer of exactly its size. */
typedef struct {
    const char *label;
    uint8_t *names;
    int32_t *offsets; /* [count + 1] */
    int32_t *kinds;
    int32_t *columns;
    int32_t count, num_floats, num_strings;
} layout;

typedef struct {
    int kind;
    char prefix;
    int num_inputs;
} argument;

/* As NativeRows.build lays out its arrays: per argument in order, its inputs <prefix>1..<prefix>n. */
static layout build_layout(const char *label, const argument *arguments, int num_arguments) {
    char names[MAX_INPUTS * 4];
    int32_t offsets[MAX_INPUTS + 1] = {0}, kinds[MAX_INPUTS], columns[MAX_INPUTS];
    int32_t count = 0, counts[2] = {0, 0};
    for (int a = 0; a < num_arguments; a++) {
        for (int i = 1; i <= arguments[a].num_inputs; i++) {
            int written = snprintf(names + offsets[count], 4, "%c%d", arguments[a].prefix, i);
            offsets[count + 1] = offsets[count] + written;
            kinds[count] = arguments[a].kind;
            columns[count] = counts[arguments[a].kind]++;
            count++;
        }
    }
    layout out = {label, malloc((size_t)offsets[count]), malloc(sizeof(int32_t) * (size_t)(count + 1)),
                  malloc(sizeof(int32_t) * (size_t)count), malloc(sizeof(int32_t) * (size_t)count), count,
                  counts[FLOAT], counts[STRING]};
    memcpy(out.names, names, (size_t)offsets[count]);
    memcpy(out.offsets, offsets, sizeof(int32_t) * (size_t)(count + 1));
    memcpy(out.kinds, kinds, sizeof(int32_t) * (size_t)count);
    memcpy(out.columns, columns, sizeof(int32_t) * (size_t)count);
    return out;
}

static layout layouts[2];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    const argument criteo[] = {{FLOAT, 'I', 13}, {STRING, 'C', 26}};
    const argument swapped[] = {{STRING, 'C', 7}, {FLOAT, 'I', 5}};
    layouts[0] = build_layout("criteo", criteo, 2);
    layouts[1] = build_layout("tests-swapped", swapped, 2);
    return 0;
}

/* One call of ctr_read_instances and its buffers. */
typedef struct {
    int64_t code;
    int64_t room;
    int64_t longest;
    float *floats;
    int64_t *spans;
    uint8_t *text;
} reading;

static void reading_free(reading *r) {
    free(r->floats);
    free(r->spans);
    free(r->text);
    r->floats = NULL;
    r->spans = NULL;
    r->text = NULL;
}

static reading read_with_room(const layout *l, const uint8_t *body, int64_t length, int64_t room) {
    reading r = {NOT_HANDLED, room, 0, NULL, NULL, NULL};
    if (room <= 0) return r; /* native_rows.py does not call it then */
    size_t num_floats = (size_t)(room * l->num_floats), num_spans = (size_t)(room * l->num_strings * 2);
    r.floats = malloc(num_floats * sizeof(float));
    r.spans = malloc(num_spans * sizeof(int64_t));
    r.text = malloc((size_t)length); /* decoded strings are never longer than the body */
    /* np.empty's garbage: a value rows.c forgot to write shows as a float out of place or a span out of bounds */
    memset(r.floats, 0xA5, num_floats * sizeof(float));
    memset(r.spans, 0xA5, num_spans * sizeof(int64_t));
    int64_t *stamps = calloc((size_t)l->count, sizeof(int64_t));
    r.longest = -12345; /* rows.c sets it: a value left here fails check_rows */
    r.code = ctr_read_instances(body, length, l->names, l->offsets, l->count, l->kinds, l->columns, l->num_floats,
                                l->num_strings, (const uint8_t *)SIGNATURE, (int32_t)strlen(SIGNATURE), room,
                                r.floats, r.spans, stamps, &r.longest, r.text);
    free(stamps);
    CHECK(r.code == NOT_HANDLED || r.code == TOO_MANY || (r.code >= 0 && r.code <= room),
          "answered %lld with room for %lld rows", (long long)r.code, (long long)room);
    return r;
}

static int64_t count_braces(const uint8_t *body, int64_t length) {
    int64_t braces = 0;
    for (int64_t i = 0; i < length; i++) braces += body[i] == '{';
    return braces;
}

static int64_t smaller(int64_t a, int64_t b) { return a < b ? a : b; }

/* NativeRows.read's calls: the guess, then room for every '{' but the body's own. */
static reading read_as_python_does(const layout *l, const uint8_t *body, int64_t length, int64_t max_rows) {
    int64_t room = smaller(max_rows, length / BYTES_PER_ROW_GUESS + 16);
    reading r = read_with_room(l, body, length, room);
    if (r.code == TOO_MANY && room < max_rows) {
        reading_free(&r);
        r = read_with_room(l, body, length, smaller(max_rows, count_braces(body, length) - 1));
    }
    return r;
}

static int same_reading(const layout *l, const reading *a, const reading *b) {
    if (a->code != b->code) return 0;
    if (a->code <= 0) return 1;
    size_t num_floats = (size_t)(a->code * l->num_floats), num_spans = (size_t)(a->code * l->num_strings * 2);
    return a->longest == b->longest && memcmp(a->floats, b->floats, num_floats * sizeof(float)) == 0 &&
           memcmp(a->spans, b->spans, num_spans * sizeof(int64_t)) == 0;
}

/* The length of the well-formed UTF-8 sequence at p, and its code point; 0 when there is none (an overlong
 * form, a surrogate, a code point above U+10FFFF, a stray or missing continuation byte). */
static int utf8_sequence(const uint8_t *p, const uint8_t *end, uint32_t *code) {
    static const uint32_t smallest[] = {0, 0, 0x80, 0x800, 0x10000};
    uint8_t b = p[0];
    int n = b < 0x80 ? 1 : b < 0xC0 ? 0 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : b < 0xF8 ? 4 : 0;
    if (n == 0 || end - p < n) return 0;
    uint32_t value = n == 1 ? b : b & (0x7Fu >> n);
    for (int i = 1; i < n; i++) {
        if ((p[i] & 0xC0) != 0x80) return 0;
        value = (value << 6) | (p[i] & 0x3Fu);
    }
    if (value < smallest[n] || value > 0x10FFFF || (value >= 0xD800 && value <= 0xDFFF)) return 0;
    *code = value;
    return n;
}

static int well_formed_text(const uint8_t *p, int64_t length) {
    const uint8_t *end = p + length;
    while (p < end) {
        uint32_t code;
        int n = utf8_sequence(p, end, &code);
        if (n == 0 || code == 0) return 0;
        p += n;
    }
    return 1;
}

static const uint8_t *span_bytes(const uint8_t *body, int64_t length, const uint8_t *text, int64_t offset) {
    return offset < length ? body + offset : text + (offset - length); /* as ctr_fill_cells reads it */
}

/* The properties of a reading of `code` > 0 rows that hold whatever the body says. */
static void check_rows(const layout *l, const uint8_t *body, int64_t length, const reading *r) {
    int64_t longest = 0;
    for (int64_t row = 0; row < r->code; row++) {
        for (int32_t column = 0; column < l->num_floats; column++) {
            float value = r->floats[row * l->num_floats + column];
            CHECK(isnan(value) || (value >= -FLT_MAX && value <= FLT_MAX), "row %lld float %d is %g",
                  (long long)row, column, (double)value);
        }
        for (int32_t column = 0; column < l->num_strings; column++) {
            int64_t offset = r->spans[(row * l->num_strings + column) * 2];
            int64_t size = r->spans[(row * l->num_strings + column) * 2 + 1];
            CHECK(size >= 0 && offset >= 0, "row %lld string %d has the span (%lld, %lld)", (long long)row, column,
                  (long long)offset, (long long)size);
            if (size > longest) longest = size;
            if (size == 0) continue;
            if (offset < length) {
                CHECK(offset >= 1 && offset + size < length && body[offset - 1] == '"' && body[offset + size] == '"',
                      "row %lld string %d: the span (%lld, %lld) is not between two quotes of the %lld-byte body",
                      (long long)row, column, (long long)offset, (long long)size, (long long)length);
                CHECK(memchr(body + offset, '\\', (size_t)size) == NULL,
                      "row %lld string %d: the body's span (%lld, %lld) holds an escape", (long long)row, column,
                      (long long)offset, (long long)size);
            } else {
                CHECK(offset - length + size <= length,
                      "row %lld string %d: the span (%lld, %lld) ends past the %lld-byte escape buffer",
                      (long long)row, column, (long long)offset, (long long)size, (long long)length);
            }
            CHECK(well_formed_text(span_bytes(body, length, r->text, offset), size),
                  "row %lld string %d is not well-formed UTF-8 or holds a zero byte", (long long)row, column);
        }
    }
    CHECK(r->longest == longest, "longest is %lld, the longest span %lld", (long long)r->longest, (long long)longest);
    if (l->num_strings == 0 || longest == 0) return; /* native_rows.py fills no cells then */
    int64_t count = r->code * l->num_strings;
    uint8_t *cells = calloc((size_t)(count * longest), 1);
    ctr_fill_cells(body, length, r->text, r->spans, count, longest, cells);
    for (int64_t i = 0; i < count; i++) {
        int64_t offset = r->spans[i * 2], size = r->spans[i * 2 + 1];
        const uint8_t *cell = cells + i * longest;
        CHECK(size == 0 || memcmp(cell, span_bytes(body, length, r->text, offset), (size_t)size) == 0,
              "cell %lld is not its span's bytes", (long long)i);
        for (int64_t j = size; j < longest; j++) CHECK(cell[j] == 0, "cell %lld has a byte past its span", (long long)i);
    }
    free(cells);
}

/* A strict, slow JSON reader of the shape rows.c reads, to compare with it. */
typedef struct {
    const uint8_t *at;
    const uint8_t *end;
} json;

static void json_space(json *j) {
    while (j->at < j->end && (*j->at == ' ' || *j->at == '\t' || *j->at == '\n' || *j->at == '\r')) j->at++;
}

static int json_take(json *j, uint8_t byte) {
    json_space(j);
    if (j->at < j->end && *j->at == byte) {
        j->at++;
        return 1;
    }
    return 0;
}

static int json_hex4(const uint8_t *p, const uint8_t *end, uint32_t *value) {
    if (end - p < 4) return 0;
    char digits[5] = {(char)p[0], (char)p[1], (char)p[2], (char)p[3], 0};
    for (int i = 0; i < 4; i++) {
        if (strchr("0123456789abcdefABCDEF", digits[i]) == NULL || digits[i] == 0) return 0;
    }
    *value = (uint32_t)strtoul(digits, NULL, 16);
    return 1;
}

static int json_encode(uint32_t code, uint8_t *out) {
    if (code < 0x80) {
        out[0] = (uint8_t)code;
        return 1;
    }
    int n = code < 0x800 ? 2 : code < 0x10000 ? 3 : 4;
    static const uint8_t lead[] = {0, 0, 0xC0, 0xE0, 0xF0};
    for (int i = n - 1; i > 0; i--) {
        out[i] = (uint8_t)(0x80 | (code & 0x3F));
        code >>= 6;
    }
    out[0] = (uint8_t)(lead[n] | code);
    return n;
}

/* A JSON string decoded into `out` (room for the rest of the body): escapes, surrogate pairs; a lone
 * surrogate refused as msgspec refuses it. */
static int json_string(json *j, uint8_t *out, int64_t *size) {
    json_space(j);
    if (j->at >= j->end || *j->at != '"') return 0;
    const uint8_t *p = j->at + 1;
    int64_t n = 0;
    while (p < j->end) {
        uint8_t b = *p;
        if (b == '"') {
            j->at = p + 1;
            *size = n;
            return 1;
        }
        if (b < 0x20) return 0;
        if (b != '\\') {
            uint32_t code;
            int k = utf8_sequence(p, j->end, &code);
            if (k == 0) return 0;
            memcpy(out + n, p, (size_t)k);
            n += k;
            p += k;
            continue;
        }
        if (j->end - p < 2) return 0;
        const char *from = "\"\\/bfnrt", *to = "\"\\/\b\f\n\r\t";
        const char *simple = p[1] != 0 ? strchr(from, p[1]) : NULL;
        if (simple != NULL) {
            out[n++] = (uint8_t)to[simple - from];
            p += 2;
            continue;
        }
        uint32_t code, low;
        if (p[1] != 'u' || !json_hex4(p + 2, j->end, &code)) return 0;
        p += 6;
        if (code >= 0xDC00 && code <= 0xDFFF) return 0;
        if (code >= 0xD800 && code <= 0xDBFF) {
            if (j->end - p < 2 || p[0] != '\\' || p[1] != 'u' || !json_hex4(p + 2, j->end, &low) || low < 0xDC00 ||
                low > 0xDFFF) {
                return 0;
            }
            code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
            p += 6;
        }
        n += json_encode(code, out + n);
    }
    return 0;
}

/* A JSON number by RFC 8259's grammar, its value from strtod over all of its text. */
static int json_number(json *j, double *value) {
    const uint8_t *p = j->at, *end = j->end;
#define DIGITS(p) ((p) < end && *(p) >= '0' && *(p) <= '9')
    if (p < end && *p == '-') p++;
    if (!DIGITS(p)) return 0;
    if (*p == '0') {
        p++;
    } else {
        while (DIGITS(p)) p++;
    }
    if (p < end && *p == '.') {
        p++;
        if (!DIGITS(p)) return 0;
        while (DIGITS(p)) p++;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < end && (*p == '+' || *p == '-')) p++;
        if (!DIGITS(p)) return 0;
        while (DIGITS(p)) p++;
    }
#undef DIGITS
    size_t size = (size_t)(p - j->at);
    char *text = malloc(size + 1);
    memcpy(text, j->at, size);
    text[size] = 0;
    char *stop;
    *value = strtod(text, &stop);
    int whole = stop == text + size;
    free(text);
    CHECK(whole, "strtod did not read all of a number of RFC 8259's grammar");
    j->at = p;
    return 1;
}

/* The first 32 bytes at p in hex, for a message. */
static const char *hex(const uint8_t *p, int64_t size, char *out) {
    int64_t shown = size < 32 ? size : 32;
    for (int64_t i = 0; i < shown; i++) snprintf(out + 2 * i, 3, "%02x", p[i]);
    out[2 * shown] = 0;
    return out;
}

static int32_t input_index(const layout *l, const uint8_t *key, int64_t size) {
    for (int32_t i = 0; i < l->count; i++) {
        if (l->offsets[i + 1] - l->offsets[i] == size && memcmp(l->names + l->offsets[i], key, (size_t)size) == 0) {
            return i;
        }
    }
    return -1;
}

/* One instance at j, compared with row `row` of the reading. `scratch`: room for the rest of the body. */
static void compare_instance(const layout *l, json *j, const uint8_t *body, int64_t length, const reading *r,
                             int64_t row, uint8_t *scratch) {
    CHECK(row < r->code, "read %lld rows of a body with more instances", (long long)r->code);
    uint32_t expected_floats[MAX_INPUTS];
    const uint8_t *expected_strings[MAX_INPUTS];
    int64_t expected_sizes[MAX_INPUTS] = {0}, used = 0;
    int seen[MAX_INPUTS] = {0};
    for (int32_t i = 0; i < l->num_floats; i++) expected_floats[i] = MISSING_FLOAT_BITS;
    CHECK(json_take(j, '{'), "row %lld is not an object", (long long)row);
    if (!json_take(j, '}')) {
        for (;;) {
            int64_t key_size;
            CHECK(json_string(j, scratch + used, &key_size), "row %lld: a key is not a JSON string", (long long)row);
            int32_t index = input_index(l, scratch + used, key_size);
            CHECK(index >= 0, "row %lld: a key that is no input was read", (long long)row);
            CHECK(!seen[index], "row %lld: a key given twice was read", (long long)row);
            seen[index] = 1;
            CHECK(json_take(j, ':'), "row %lld: no ':' after a key", (long long)row);
            json_space(j);
            int32_t column = l->columns[index];
            if (j->end - j->at >= 4 && memcmp(j->at, "null", 4) == 0) {
                j->at += 4;
            } else if (l->kinds[index] == FLOAT) {
                double value;
                CHECK(json_number(j, &value), "row %lld: a float's value is not a JSON number or null", (long long)row);
                CHECK(fabs(value) <= FLT_MAX, "row %lld: %g, outside float32, was read", (long long)row, value);
                float rounded = (float)value;
                memcpy(&expected_floats[column], &rounded, sizeof rounded);
            } else {
                int64_t size;
                CHECK(json_string(j, scratch + used, &size), "row %lld: a string's value is not a JSON string or null",
                      (long long)row);
                expected_strings[column] = scratch + used;
                expected_sizes[column] = size;
                used += size;
            }
            if (json_take(j, ',')) continue;
            CHECK(json_take(j, '}'), "row %lld: no ',' or '}' after a value", (long long)row);
            break;
        }
    }
    for (int32_t column = 0; column < l->num_floats; column++) {
        uint32_t got;
        memcpy(&got, &r->floats[row * l->num_floats + column], sizeof got);
        CHECK(got == expected_floats[column], "row %lld float %d: read 0x%08x, strtod gives 0x%08x", (long long)row,
              column, got, expected_floats[column]);
    }
    for (int32_t column = 0; column < l->num_strings; column++) {
        int64_t offset = r->spans[(row * l->num_strings + column) * 2];
        int64_t size = r->spans[(row * l->num_strings + column) * 2 + 1];
        const uint8_t *got = size > 0 ? span_bytes(body, length, r->text, offset) : body;
        if (size == expected_sizes[column] && (size == 0 || memcmp(got, expected_strings[column], (size_t)size) == 0)) {
            continue;
        }
        char read_hex[2 * 32 + 1], decoded_hex[2 * 32 + 1];
        CHECK(0, "row %lld string %d: read %lld bytes %s, the string decodes to %lld bytes %s", (long long)row, column,
              (long long)size, hex(got, size, read_hex), (long long)expected_sizes[column],
              hex(expected_strings[column], expected_sizes[column], decoded_hex));
    }
}

/* A body rows.c read (`code` >= 0 rows) against the strict reader. */
static void compare_body(const layout *l, const uint8_t *body, int64_t length, const reading *r) {
    json j = {body, body + length};
    uint8_t *scratch = malloc((size_t)length + 1);
    int have_instances = 0, have_signature = 0;
    int64_t rows = 0, size;
    CHECK(json_take(&j, '{'), "a body that is not an object was read");
    for (;;) {
        CHECK(json_string(&j, scratch, &size), "a body's key is not a JSON string");
        CHECK(json_take(&j, ':'), "no ':' after a body's key");
        if (size == 9 && memcmp(scratch, "instances", 9) == 0) {
            CHECK(!have_instances, "a body with \"instances\" twice was read");
            have_instances = 1;
            CHECK(json_take(&j, '['), "\"instances\" that is not an array was read");
            if (!json_take(&j, ']')) {
                for (;;) {
                    compare_instance(l, &j, body, length, r, rows++, scratch);
                    if (json_take(&j, ',')) continue;
                    CHECK(json_take(&j, ']'), "no ',' or ']' after an instance");
                    break;
                }
            }
        } else if (size == 14 && memcmp(scratch, "signature_name", 14) == 0) {
            CHECK(!have_signature, "a body with \"signature_name\" twice was read");
            have_signature = 1;
            CHECK(json_string(&j, scratch, &size) && size == (int64_t)strlen(SIGNATURE) &&
                      memcmp(scratch, SIGNATURE, (size_t)size) == 0,
                  "a body with another signature_name was read");
        } else {
            CHECK(0, "a body with a key other than \"instances\" and \"signature_name\" was read");
        }
        if (json_take(&j, ',')) continue;
        CHECK(json_take(&j, '}'), "no ',' or '}' after a body's value");
        break;
    }
    json_space(&j);
    CHECK(j.at == j.end, "a body with bytes after its object was read");
    CHECK(have_instances, "a body without \"instances\" was read");
    CHECK(rows == r->code, "read %lld rows of a body of %lld instances", (long long)r->code, (long long)rows);
    free(scratch);
}

static void fuzz_layout(const layout *l, const uint8_t *body, int64_t length) {
    current_layout = l->label;
    reading r = read_as_python_does(l, body, length, 1000);
    int64_t enough = count_braces(body, length);
    if (r.code == TOO_MANY) {
        reading more = read_with_room(l, body, length, enough);
        CHECK(more.code != TOO_MANY, "room for %lld rows, the body's '{' count, was too little", (long long)enough);
        CHECK(more.code == NOT_HANDLED || more.code > r.room,
              "TOO_MANY with room for %lld rows, yet %lld rows with more room", (long long)r.room, (long long)more.code);
        reading_free(&more);
    }
    if (r.code > 0) check_rows(l, body, length, &r);
    if (r.code >= 0) compare_body(l, body, length, &r);
    if (r.code > 0) {
        reading exact = read_with_room(l, body, length, r.code);
        CHECK(same_reading(l, &r, &exact), "%lld rows read differently with room for exactly them",
              (long long)r.code);
        reading_free(&exact);
    }
    reading few = read_as_python_does(l, body, length, 3);
    if (r.code > 3) {
        CHECK(few.code == TOO_MANY, "%lld rows under a limit of 3 answered %lld", (long long)r.code,
              (long long)few.code);
    } else if (r.code > 0) {
        CHECK(same_reading(l, &r, &few), "%lld rows read differently under a limit of 3", (long long)r.code);
    } else {
        CHECK(few.code <= 0, "a body not read under a limit of 1000 was read under a limit of 3");
    }
    reading_free(&few);
    reading_free(&r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint8_t *body = malloc(size); /* exactly the body: no trailing zero to hide a read past it */
    if (size) memcpy(body, data, size);
    for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++) fuzz_layout(&layouts[i], body, (int64_t)size);
    free(body);
    return 0;
}
