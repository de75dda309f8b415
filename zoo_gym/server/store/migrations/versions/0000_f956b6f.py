"""f956b6f: the schema the first code users ran wrote (the main of 2026-11-23)

Revision ID: 0000
Revises:
Create Date: 2026-11-23

A database made by f956b6f's `gym-server init` has these tables, no roundinputs table and no alembic_version
table; zoo_gym.server.store.migrations reads it as this revision. The same tables as f956b6f's models
(tests/fixtures/state-f956b6f was written by that code), with SQLModel's AutoString and UTCDateTime written as the
plain types they store (VARCHAR, TIMESTAMP WITH TIME ZONE).
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0000"
down_revision: Union[str, Sequence[str], None] = None
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """The tables in the order f956b6f's own `init` created them."""
    _checkpoint_and_contributor()
    _ledger_and_reputation()
    _rounds_and_submissions()


def _checkpoint_and_contributor() -> None:
    op.create_table('checkpoint',
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('round_id', sa.Integer(), nullable=False),
    sa.Column('parent_sha256', sa.String(length=64), nullable=True),
    sa.Column('size', sa.Integer(), nullable=False),
    sa.Column('heldout_loss', sa.Float(), nullable=True),
    sa.Column('manifest_json', sa.String(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('sha256')
    )
    with op.batch_alter_table('checkpoint', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_checkpoint_round_id'), ['round_id'], unique=False)

    op.create_table('contributor',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('public_key', sa.String(length=64), nullable=False),
    sa.Column('display_name', sa.String(length=64), nullable=False),
    sa.Column('registered_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )


def _ledger_and_reputation() -> None:
    op.create_table('ledger_entry',
    sa.Column('round_id', sa.Integer(), nullable=False),
    sa.Column('contributor', sa.String(length=128), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('amount', sa.BigInteger(), nullable=False),
    sa.Column('score', sa.Float(), nullable=False),
    sa.Column('reputation_after', sa.Float(), nullable=False),
    sa.Column('reason', sa.String(), nullable=False),
    sa.Column('prev_hash', sa.String(length=64), nullable=False),
    sa.Column('entry_hash', sa.String(length=64), nullable=False),
    sa.Column('signature', sa.String(length=128), nullable=False),
    sa.Column('seq', sa.Integer(), autoincrement=False, nullable=False),
    sa.PrimaryKeyConstraint('seq'),
    sa.UniqueConstraint('entry_hash')
    )
    with op.batch_alter_table('ledger_entry', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_ledger_entry_contributor'), ['contributor'], unique=False)
        batch_op.create_index(batch_op.f('ix_ledger_entry_round_id'), ['round_id'], unique=False)

    op.create_table('reputation',
    sa.Column('value', sa.Float(), nullable=False),
    sa.Column('rounds', sa.Integer(), nullable=False),
    sa.Column('updated_round', sa.Integer(), nullable=False),
    sa.Column('contributor', sa.String(length=128), nullable=False),
    sa.PrimaryKeyConstraint('contributor')
    )


def _rounds_and_submissions() -> None:
    op.create_table('round',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('state', sa.Enum('OPEN', 'AGGREGATING', 'PUBLISHED', 'HALTED', name='roundstate'), nullable=False),
    sa.Column('base_sha256', sa.String(length=64), nullable=False),
    sa.Column('opened_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('deadline_unix', sa.Float(), nullable=False),
    sa.Column('closed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('published_sha256', sa.String(length=64), nullable=True),
    sa.Column('aggregator', sa.String(), nullable=False),
    sa.Column('report_json', sa.String(), nullable=False),
    sa.Column('dp_epsilon_round', sa.Float(), nullable=True),
    sa.Column('dp_epsilon_total', sa.Float(), nullable=True),
    sa.Column('dp_noise_multiplier', sa.Float(), nullable=True),
    sa.Column('dp_sample_rate', sa.Float(), nullable=True),
    sa.Column('message', sa.String(), nullable=False),
    sa.Column('needs', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_table('submission',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('round_id', sa.Integer(), nullable=False),
    sa.Column('contributor_id', sa.String(length=32), nullable=False),
    sa.Column('base_sha256', sa.String(length=64), nullable=False),
    sa.Column('payload_sha256', sa.String(length=64), nullable=False),
    sa.Column('payload_size', sa.Integer(), nullable=False),
    sa.Column('codecs', sa.String(), nullable=False),
    sa.Column('metadata_json', sa.String(), nullable=False),
    sa.Column('received_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('round_id', 'contributor_id', name='one_submission_per_round')
    )
    with op.batch_alter_table('submission', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_submission_contributor_id'), ['contributor_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_submission_round_id'), ['round_id'], unique=False)

    op.create_table('usednonce',
    sa.Column('contributor_id', sa.String(length=32), nullable=False),
    sa.Column('nonce', sa.String(length=32), nullable=False),
    sa.Column('method', sa.String(), nullable=False),
    sa.Column('used_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('contributor_id', 'nonce')
    )


def downgrade() -> None:
    op.drop_table('usednonce')
    op.drop_table('submission')
    op.drop_table('round')
    op.drop_table('reputation')
    op.drop_table('ledger_entry')
    op.drop_table('contributor')
    op.drop_table('checkpoint')
    sa.Enum(name="roundstate").drop(op.get_bind(), checkfirst=True)
