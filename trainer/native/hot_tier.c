/* The hot tier's work per batch in one call each, instead of numpy's dozens of small operations a batch:
 *
 * - ctr_plan: the plans of trainer.hot_tier.HotTierPlanner, the same slots, loads and write-backs in the same
 *   order (tests/trainer/test_hot_tier.py compares them plan by plan);
 * - ctr_map_*: trainer.row_map.RowMap's row -> int64 map (a row store's log index: tests/trainer/
 *   test_row_map.py runs both against a dict).
 *
 * Loaded by trainer/native_tier.py. The planner's state, every array owned by the caller (numpy):
 *   table[capacity][2]     row -> slot: (row, slot) entries, open addressing with linear probing, EMPTY rows
 *                          free; capacity a power of two >= 2 * hot_rows; removal shifts entries back (no
 *                          tombstones). An entry's row and slot share a cache line.
 *   slots[hot_rows][4]     each slot's row (EMPTY when free), the slots before and after it in a list of the
 *                          slots in use from least to most recently used, and 1 where a training step may have
 *                          changed the slot since it was loaded: a slot's record is one cache line's half.
 *   scalars[3]             the list's least and most recent slot (EMPTY when empty), slots in use
 *
 * Recency is by batch; within a batch, lower row ids count as used earlier. Free slots are taken lowest first,
 * then the least recently used slots the batch does not read, the loads in ascending row order taking them in
 * that order. Nothing is changed by a call that fails.
 */
#include <stdint.h>
#include <string.h>

#define EMPTY (-1)
#define CTR_PLAN_TOO_MANY_ROWS (-1)
#define CTR_PLAN_NEGATIVE_ID (-2)
#define CTR_MAP_ABSENT (-1)

enum { ROW, OLDER, NEWER, DIRTY, SLOT_FIELDS };

typedef struct {
    int64_t id;
    int64_t position;
} keyed;

/* Sorts `count` (id, position) pairs by id, positions ascending among equal ids: least significant byte first,
 * one stable counting pass per byte in which the ids differ. `spare` holds `count` pairs; the result may end
 * in either buffer, which is returned. */
static keyed *sort_by_id(keyed *items, keyed *spare, int64_t count) {
    uint64_t any = 0, all = ~(uint64_t)0;
    for (int64_t k = 0; k < count; k++) {
        any |= (uint64_t)items[k].id;
        all &= (uint64_t)items[k].id;
    }
    uint64_t differing = any ^ all;
    for (int byte = 0; byte < 8; byte++) {
        int shift = 8 * byte;
        if (!((differing >> shift) & 0xFF)) continue;
        int64_t start[256] = {0};
        for (int64_t k = 0; k < count; k++) start[((uint64_t)items[k].id >> shift) & 0xFF]++;
        for (int64_t d = 0, sum = 0; d < 256; d++) {
            int64_t here = start[d];
            start[d] = sum;
            sum += here;
        }
        for (int64_t k = 0; k < count; k++) spare[start[((uint64_t)items[k].id >> shift) & 0xFF]++] = items[k];
        keyed *swap = items;
        items = spare;
        spare = swap;
    }
    return items;
}

static inline uint64_t home(int64_t row, int shift) {
    return ((uint64_t)row * 0x9E3779B97F4A7C15ULL) >> shift;
}

static int shift_of(int64_t capacity) {
    int shift = 64;
    for (int64_t c = capacity; c > 1; c >>= 1) shift--;
    return shift;
}

/* The entry holding `row`, else the free entry that ends its run (where it would go). */
static uint64_t probe(const int64_t (*table)[2], uint64_t mask, int shift, int64_t row) {
    uint64_t at = home(row, shift);
    while (table[at][0] != row && table[at][0] != EMPTY) at = (at + 1) & mask;
    return at;
}

static int64_t find(const int64_t (*table)[2], uint64_t mask, int shift, int64_t row) {
    uint64_t at = probe(table, mask, shift, row);
    return table[at][0] == EMPTY ? EMPTY : table[at][1];
}

static void insert(int64_t (*table)[2], uint64_t mask, int shift, int64_t row, int64_t slot) {
    uint64_t at = home(row, shift);
    while (table[at][0] != EMPTY) at = (at + 1) & mask;
    table[at][0] = row;
    table[at][1] = slot;
}

static void erase(int64_t (*table)[2], uint64_t mask, int shift, int64_t row) {
    uint64_t at = home(row, shift);
    while (table[at][0] != row) at = (at + 1) & mask;
    /* Backward shift: move later entries of the run into the hole where their home allows it. */
    uint64_t hole = at;
    for (uint64_t next = (hole + 1) & mask; table[next][0] != EMPTY; next = (next + 1) & mask) {
        uint64_t want = home(table[next][0], shift);
        /* The entry at `next` stays unless its home lies cyclically outside (hole, next]. */
        int stays = (hole <= next) ? (want > hole && want <= next) : (want > hole || want <= next);
        if (!stays) {
            table[hole][0] = table[next][0];
            table[hole][1] = table[next][1];
            hole = next;
        }
    }
    table[hole][0] = EMPTY;
}

static void unlink_slot(int64_t (*slots)[SLOT_FIELDS], int64_t *scalars, int64_t slot) {
    int64_t before = slots[slot][OLDER], after = slots[slot][NEWER];
    if (before == EMPTY) scalars[0] = after; else slots[before][NEWER] = after;
    if (after == EMPTY) scalars[1] = before; else slots[after][OLDER] = before;
    slots[slot][OLDER] = slots[slot][NEWER] = EMPTY;
}

static void append_slot(int64_t (*slots)[SLOT_FIELDS], int64_t *scalars, int64_t slot) {
    slots[slot][OLDER] = scalars[1];
    slots[slot][NEWER] = EMPTY;
    if (scalars[1] == EMPTY) scalars[0] = slot; else slots[scalars[1]][NEWER] = slot;
    scalars[1] = slot;
}

/* Plans a batch of `count` row ids. `scratch` holds 4 * count int64; `out` holds 7 * count int64, filled as
 * seven arrays of `count`: slot_ids (per id, in the ids' order), the distinct rows ascending and their slots,
 * load_rows, load_slots, write_back_slots, write_back_rows. `counts` gets the distinct rows, the loads and the
 * write-backs. Returns 0, or CTR_PLAN_TOO_MANY_ROWS (counts[0] set) or CTR_PLAN_NEGATIVE_ID, changing nothing. */
int64_t ctr_plan(int64_t hot_rows, int64_t capacity, int64_t (*table)[2], int64_t (*slots)[SLOT_FIELDS],
                 int64_t *scalars, const int64_t *ids, int64_t count, int32_t training, int64_t *scratch,
                 int64_t *out, int64_t *counts) {
    uint64_t mask = (uint64_t)capacity - 1;
    int shift = shift_of(capacity);
    keyed *items = (keyed *)scratch;
    for (int64_t k = 0; k < count; k++) {
        if (ids[k] < 0) return CTR_PLAN_NEGATIVE_ID;
        items[k].id = ids[k];
        items[k].position = k;
    }
    keyed *sorted = sort_by_id(items, items + count, count);
    int64_t *slot_ids = out, *unique = out + count, *unique_slots = out + 2 * count;
    int64_t *load_rows = out + 3 * count, *load_slots = out + 4 * count;
    int64_t *write_back_slots = out + 5 * count, *write_back_rows = out + 6 * count;
    int64_t num_unique = 0;
    for (int64_t k = 0; k < count; k++)
        if (k == 0 || sorted[k].id != sorted[k - 1].id) unique[num_unique++] = sorted[k].id;
    counts[0] = num_unique;
    if (num_unique > hot_rows) return CTR_PLAN_TOO_MANY_ROWS;
    /* The batch's resident slots leave the list (they go back at its end below), so no victim is one. */
    for (int64_t u = 0; u < num_unique; u++) {
        int64_t slot = find((const int64_t (*)[2])table, mask, shift, unique[u]);
        unique_slots[u] = slot;
        if (slot != EMPTY) unlink_slot(slots, scalars, slot);
    }
    int64_t num_loads = 0, num_write_backs = 0;
    for (int64_t u = 0; u < num_unique; u++) {
        if (unique_slots[u] != EMPTY) continue;
        int64_t slot;
        if (scalars[2] < hot_rows) {
            slot = scalars[2]++;
        } else {
            slot = scalars[0];  /* the least recently used slot the batch does not read */
            unlink_slot(slots, scalars, slot);
            int64_t victim = slots[slot][ROW];
            if (slots[slot][DIRTY]) {
                write_back_slots[num_write_backs] = slot;
                write_back_rows[num_write_backs++] = victim;
                slots[slot][DIRTY] = 0;
            }
            erase(table, mask, shift, victim);
        }
        insert(table, mask, shift, unique[u], slot);
        slots[slot][ROW] = unique[u];
        unique_slots[u] = slot;
        load_rows[num_loads] = unique[u];
        load_slots[num_loads++] = slot;
    }
    for (int64_t u = 0; u < num_unique; u++) {
        append_slot(slots, scalars, unique_slots[u]);
        if (training) slots[unique_slots[u]][DIRTY] = 1;
    }
    for (int64_t k = 0, u = -1; k < count; k++) {
        if (k == 0 || sorted[k].id != sorted[k - 1].id) u++;
        slot_ids[sorted[k].position] = unique_slots[u];
    }
    counts[1] = num_loads;
    counts[2] = num_write_backs;
    return 0;
}

/* A row -> value map: the planner's table on its own, `capacity` (a power of two) entries of (row, value), rows
 * >= 0. The caller keeps it at most half full (ctr_map_rehash into a table twice the size first). */

/* values[k] = the value of rows[k], CTR_MAP_ABSENT where absent; returns how many were present. */
int64_t ctr_map_lookup(const int64_t (*table)[2], int64_t capacity, const int64_t *rows, int64_t count,
                       int64_t *values) {
    uint64_t mask = (uint64_t)capacity - 1;
    int shift = shift_of(capacity);
    int64_t present = 0;
    for (int64_t k = 0; k < count; k++) {
        values[k] = find(table, mask, shift, rows[k]);
        present += values[k] != CTR_MAP_ABSENT;
    }
    return present;
}

/* Sets rows[k] to values[k], adding absent rows (a row given twice ends with its later value); returns how many
 * were present before. */
int64_t ctr_map_set(int64_t (*table)[2], int64_t capacity, const int64_t *rows, const int64_t *values,
                    int64_t count) {
    uint64_t mask = (uint64_t)capacity - 1;
    int shift = shift_of(capacity);
    int64_t present = 0;
    for (int64_t k = 0; k < count; k++) {
        uint64_t at = probe((const int64_t (*)[2])table, mask, shift, rows[k]);
        present += table[at][0] != EMPTY;
        table[at][0] = rows[k];
        table[at][1] = values[k];
    }
    return present;
}

/* Removes the rows that are present; returns how many were. */
int64_t ctr_map_remove(int64_t (*table)[2], int64_t capacity, const int64_t *rows, int64_t count) {
    uint64_t mask = (uint64_t)capacity - 1;
    int shift = shift_of(capacity);
    int64_t removed = 0;
    for (int64_t k = 0; k < count; k++) {
        if (find((const int64_t (*)[2])table, mask, shift, rows[k]) == EMPTY) continue;
        erase(table, mask, shift, rows[k]);
        removed++;
    }
    return removed;
}

/* Puts every entry of `table` into `bigger` (empty, `bigger_capacity` entries). */
void ctr_map_rehash(const int64_t (*table)[2], int64_t capacity, int64_t (*bigger)[2], int64_t bigger_capacity) {
    uint64_t mask = (uint64_t)bigger_capacity - 1;
    int shift = shift_of(bigger_capacity);
    for (int64_t at = 0; at < capacity; at++)
        if (table[at][0] != EMPTY) insert(bigger, mask, shift, table[at][0], table[at][1]);
}
